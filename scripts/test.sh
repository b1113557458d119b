#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup_env.sh) and runs pytest with the arguments given.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export WANDB_MODE=disabled OMP_NUM_THREADS=1
exec "$root/.venv/bin/python" -m pytest -q "$@"
