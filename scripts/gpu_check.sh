#!/usr/bin/env bash
# The GPU check, one command on a machine with one or more NVIDIA GPUs:
#   1. the tests marked `gpu` (tests/test_gpu.py): the one-process model on CUDA against the CPU
#      oracle, bf16, offload and recomputation on CUDA, TP / PP / ZeRO over NCCL and mixture of
#      experts (one GPU; EP 2 all-to-all, expert TP 2, EP 2 allgather over NCCL) on as many GPUs as
#      the machine has (layouts needing more are skipped);
#   2. scripts/bench_gpu.py: one-GPU model TFLOP/s and MFU of a ~1.3B-parameter GPT in bf16, with
#      and without recomputation and with --compile, next to transformers' GPT-2 model of the same
#      shape.
#
#   bash scripts/gpu_check.sh                  # both
#   bash scripts/gpu_check.sh --tests-only     # or --bench-only
#   bash scripts/gpu_check.sh -- -k nccl       # arguments after -- go to pytest
#   bash scripts/gpu_check.sh --dry-run        # print the commands, run nothing (works without a GPU)
#
# Exit status: that of the failing step; 2 for a bad argument; 3 when torch sees no GPU.
# Uses .venv (scripts/setup_env.sh installs a CUDA build of torch when a GPU is present), or
# $PYTHON when set (megazero need not be installed there: the checkout is put on its path).  Run on
# one H200 on 2026-12-04 (docs/performance.md, "The GPU path").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
dry=0 tests=1 bench=1 bench_args=() pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --tests-only) bench=0 ;;
    --bench-only) tests=0 ;;
    --quick) bench_args+=(--quick) ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]; then
  echo "gpu_check.sh: --tests-only and --bench-only exclude each other" >&2; exit 2
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  [ "$dry" -eq 1 ] || bash "$root/scripts/setup_env.sh"
  PY="$root/.venv/bin/python"
fi
cd "$root"
# a $PYTHON without megazero installed (a machine's own torch, no network to install into): the
# checkout on the path, and models/ under its installed name megazero_models
if [ "$dry" -eq 0 ] && ! "$PY" -c 'import megazero, megazero_models' 2>/dev/null; then
  shim="$(mktemp -d)"
  ln -s "$root/models" "$shim/megazero_models"
  export PYTHONPATH="$root:$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
run() { echo "+ $*"; if [ "$dry" -eq 0 ]; then "$@"; fi; }
if [ "$dry" -eq 0 ]; then
  gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  if [ "$gpus" -eq 0 ]; then
    echo "gpu_check.sh: torch sees no NVIDIA GPU (torch.cuda.is_available() is False); nothing to check" >&2
    exit 3
  fi
  echo "gpu_check.sh: $gpus GPU(s): $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')"
fi
# one intra-op thread per rank unless set: the rule and its reasons live in megazero/process/threads.py
export WANDB_MODE=disabled OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$tests" -eq 1 ]; then
  run "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py ${pytest_args[@]+"${pytest_args[@]}"}
fi
if [ "$bench" -eq 1 ]; then
  run "$PY" scripts/bench_gpu.py ${bench_args[@]+"${bench_args[@]}"}
fi
