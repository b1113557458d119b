#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install megazero with what it needs.
# Installs a CPU build of torch when the machine has no NVIDIA GPU and no torch yet; an
# existing torch is left alone.  Safe to run repeatedly: a stamp skips work already done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$root/.venv/bin/python"
stamp=".venv/.megazero-installed"
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.6"          # CUDA build from the index
  else
    # CPU build: the pinned version is on local disk here; elsewhere use PyTorch's CPU index
    "$VPY" -m pip install -q torch==2.13.0 \
      || "$VPY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# an older torch already here: say so rather than let pip replace it with whatever the index has
if ! "$VPY" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 6))"; then
  echo "setup_env.sh: torch $("$VPY" -c 'import torch; print(torch.__version__)') is older than the 2.6 megazero needs" \
       "(transformers 5 refuses older ones); upgrade it (CPU: pip install torch==2.13.0) or use a fresh venv" >&2
  exit 2
fi
"$VPY" -m pip install -q -e ".[test]"
echo "$want" > "$stamp"
