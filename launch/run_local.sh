#!/usr/bin/env bash
# Train on one node: one process per GPU (or NPROC processes on CPUs) under torchrun.
#   launch/run_local.sh [--max-restarts N] [--run-dir DIR] [--] [pretrain_gpt.py flags...]
#   NPROC=8 launch/run_local.sh --max-restarts 3 -- --save ckpt --load ckpt --mock-data ...
# NPROC defaults to the number of GPUs, or 1 without any.  On CPUs each rank uses one thread
# (OMP_NUM_THREADS=1) unless OMP_NUM_THREADS is set.
#
# Crash recovery: with --max-restarts N (or MAX_RESTARTS) torchrun restarts every rank after a
# failure, up to N times, through c10d rendezvous; pass the same --save and --load directory and
# each restart resumes from the last complete checkpoint.  Logs: every rank's stdout and stderr go
# to the console and to RUN_DIR/logs/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log
# (RUN_DIR: --run-dir, or runs/<date>-<pid>).  torchrun runs through scripts/launch.py: after a failure
# one line names the first failing rank and its status (the launcher's exit status); a SIGTERM or
# SIGINT to the launcher is forwarded to the ranks once (with --exit-signal-handler they save and
# exit 0, and so does the launcher).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
MAX_RESTARTS="${MAX_RESTARTS:-0}"
RUN_DIR="${RUN_DIR:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
case "$MAX_RESTARTS" in
  ''|*[!0-9]*) echo "run_local.sh: --max-restarts needs a whole number, got '$MAX_RESTARTS'" >&2; exit 2 ;;
esac
if [ -z "${NPROC:-}" ]; then
  NPROC=1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC="$(nvidia-smi -L | wc -l)"
  fi
fi
RUN_DIR="${RUN_DIR:-runs/$(date +%Y%m%d-%H%M%S)-$$}"
mkdir -p "$RUN_DIR/logs"
echo "run_local.sh: $NPROC processes, up to $MAX_RESTARTS restarts; per-rank logs in $RUN_DIR/logs" >&2
# one intra-op thread per rank unless set: the rule and its reasons live in megazero/process/threads.py
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --standalone: c10d rendezvous on a free local port, so restarted workers meet afresh
exec "$PY" "$root/scripts/launch.py" --standalone --nnodes 1 --nproc-per-node "$NPROC" \
  --max-restarts "$MAX_RESTARTS" --log-dir "$RUN_DIR/logs" --tee 3 \
  "$root/scripts/pretrain_gpt.py" "$@"
