#!/usr/bin/env bash
# Train on several nodes with torchrun: run this once on every node.
#   launch/run_multinode.sh --nnodes 2 --node-rank 0 --master-addr node0 [--master-port 29500] \
#       [--nproc-per-node 8] -- [pretrain_gpt.py flags...]
# The same settings can come from the environment: NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# NPROC_PER_NODE (default: the node's GPU count, or 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
NNODES="${NNODES:-}" NODE_RANK="${NODE_RANK:-}" MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}" NPROC_PER_NODE="${NPROC_PER_NODE:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) NNODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --master-addr) MASTER_ADDR="$2"; shift 2 ;;
    --master-port) MASTER_PORT="$2"; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
missing=""
[ -n "$NNODES" ] || missing="$missing --nnodes"
[ -n "$NODE_RANK" ] || missing="$missing --node-rank"
[ -n "$MASTER_ADDR" ] || missing="$missing --master-addr"
if [ -n "$missing" ]; then
  echo "run_multinode.sh: missing$missing (or NNODES / NODE_RANK / MASTER_ADDR in the environment)" >&2
  exit 2
fi
if [ -z "$NPROC_PER_NODE" ]; then
  NPROC_PER_NODE=1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NPROC_PER_NODE="$(nvidia-smi -L | wc -l)"
  fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --nproc-per-node "$NPROC_PER_NODE" \
  "$root/scripts/pretrain_gpt.py" "$@"
