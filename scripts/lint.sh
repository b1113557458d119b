#!/usr/bin/env bash
# The linter: flake8 with the repository's settings (setup.cfg) over the Python code; fails on any
# violation.  Sets up .venv first (scripts/setup_env.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m flake8 megazero models scripts tests "$@"
