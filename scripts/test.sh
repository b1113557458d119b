#!/usr/bin/env bash
# The test suite: sets up .venv (scripts/setup_env.sh) and runs pytest, on two workers, with the
# arguments given.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
# byte-compile the sources once: every test that starts python reads them instead of compiling them
# again (with PYTHONDONTWRITEBYTECODE set, as on CI machines, nothing else would keep them)
"$root/.venv/bin/python" -m compileall -q megazero models scripts >/dev/null
# one intra-op thread per test process (megazero/process/threads.py states the rule for ranks)
export WANDB_MODE=disabled OMP_NUM_THREADS=1
# two pytest workers (pytest-xdist) where there are two cores or more: the multi-rank tests fork
# their ranks either way; MEGAZERO_TEST_WORKERS=N sets the count, 0 (or -n 0) runs one process
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # nproc heeds OMP_NUM_THREADS
workers="${MEGAZERO_TEST_WORKERS:-$(if [ "$cores" -ge 2 ]; then echo 2; else echo 0; fi)}"
exec "$root/.venv/bin/python" -m pytest -q -n "$workers" "$@"
