#!/usr/bin/env bash
# Train on several nodes with torchrun and c10d rendezvous: run this once on every node.
#   launch/run_multinode.sh --nnodes 2 --master-addr node0 [--master-port 29500] [--nproc-per-node 8] \
#       [--max-restarts 3] [--rdzv-id my-job] [--run-dir DIR] [--node-rank R] [--join-timeout SECS] \
#       [--rdzv-conf K=V,...] [--local-addr ADDR] -- [pretrain_gpt.py flags...]
# The same settings can come from the environment: NNODES, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE
# (default: the node's GPU count, or 1), MAX_RESTARTS (default 0), RDZV_ID (default megazero), RUN_DIR,
# NODE_RANK, JOIN_TIMEOUT (default 600), RDZV_CONF (torchrun's --rdzv-conf: join_timeout,
# last_call_timeout, keep_alive_interval, keep_alive_max_attempt), LOCAL_ADDR (this node's address,
# where the workers' store listens when this node is torchrun's group rank 0).
#
# A node that dies: with --max-restarts N the other nodes stop their ranks and wait (the rendezvous'
# join_timeout, 600 s) for it in a new rendezvous round; start it again with the same command and the
# job goes on from the last checkpoint (--save DIR --load DIR).  Node rank 0 (the rendezvous host)
# serves the rendezvous store: if it dies, every node exits 1 and the job is started again.
#
# --nnodes may be a range MIN:MAX (elastic): after a node is lost the others restart and, once
# MIN nodes are back, go on with fewer data-parallel ranks; with --save DIR --load DIR every
# restart resumes from the last complete checkpoint, resharded to the new world size.
# --node-rank is not needed (c10d rendezvous numbers the nodes), but with it a node whose peers never
# join names the missing node ranks: before torchrun every node waits for the others at
# MASTER_ADDR:MASTER_PORT+1000, printing a line every 30 s, and after --join-timeout seconds names
# the missing nodes and exits 1 (0: no wait; see docs/operations.md).  Logs: every rank's
# stdout and stderr go to the console and to RUN_DIR/logs/<host>/<run id>/attempt_<k>/<local rank>/.
# torchrun runs through scripts/launch.py: one line after a failure, a termination signal forwarded once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
NNODES="${NNODES:-}" MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}" NPROC_PER_NODE="${NPROC_PER_NODE:-}"
MAX_RESTARTS="${MAX_RESTARTS:-0}" RDZV_ID="${RDZV_ID:-megazero}" RUN_DIR="${RUN_DIR:-}"
JOIN_TIMEOUT="${JOIN_TIMEOUT:-600}" RDZV_CONF="${RDZV_CONF:-}" LOCAL_ADDR="${LOCAL_ADDR:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) NNODES="$2"; shift 2 ;;
    --node-rank) export NODE_RANK="$2"; shift 2 ;;  # for the launcher's join; c10d numbers the ranks
    --master-addr) MASTER_ADDR="$2"; shift 2 ;;
    --master-port) MASTER_PORT="$2"; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE="$2"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --rdzv-id) RDZV_ID="$2"; shift 2 ;;
    --run-dir) RUN_DIR="$2"; shift 2 ;;
    --join-timeout) JOIN_TIMEOUT="$2"; shift 2 ;;
    --rdzv-conf) RDZV_CONF="$2"; shift 2 ;;
    --local-addr) LOCAL_ADDR="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
missing=""
[ -n "$NNODES" ] || missing="$missing --nnodes"
[ -n "$MASTER_ADDR" ] || missing="$missing --master-addr"
if [ -n "$missing" ]; then
  echo "run_multinode.sh: missing$missing (or NNODES / MASTER_ADDR in the environment)" >&2
  exit 2
fi
case "$MAX_RESTARTS" in
  ''|*[!0-9]*) echo "run_multinode.sh: --max-restarts needs a whole number, got '$MAX_RESTARTS'" >&2; exit 2 ;;
esac
if [ -z "$NPROC_PER_NODE" ]; then
  NPROC_PER_NODE=1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC_PER_NODE="$(nvidia-smi -L | wc -l)"
  fi
fi
RUN_DIR="${RUN_DIR:-runs/$RDZV_ID}"
LOG_DIR="$RUN_DIR/logs/$(hostname)"
mkdir -p "$LOG_DIR"
# one intra-op thread per rank unless set: the rule and its reasons live in megazero/process/threads.py
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
extra=()
[ -z "$RDZV_CONF" ] || extra+=(--rdzv-conf "$RDZV_CONF")
[ -z "$LOCAL_ADDR" ] || extra+=(--local-addr "$LOCAL_ADDR")
exec "$PY" "$root/scripts/launch.py" --join-timeout "$JOIN_TIMEOUT" --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
  --max-restarts "$MAX_RESTARTS" --log-dir "$LOG_DIR" --tee 3 ${extra[@]+"${extra[@]}"} \
  "$root/scripts/pretrain_gpt.py" "$@"
