#!/usr/bin/env bash
# Train on one node: one process per GPU (or NPROC processes on CPUs) under torchrun.
#   launch/run_local.sh [pretrain_gpt.py flags...]
#   NPROC=8 launch/run_local.sh --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --mock-data
# NPROC defaults to the number of GPUs, or 1 without any.  On CPUs each rank uses one thread
# (OMP_NUM_THREADS=1) unless OMP_NUM_THREADS is set.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if [ -z "${NPROC:-}" ]; then
  NPROC=1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC="$(nvidia-smi -L | wc -l)"
  fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC" \
  "$root/scripts/pretrain_gpt.py" "$@"
