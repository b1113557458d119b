#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install megazero with what it needs.
# Installs a CPU build of torch when the machine has no NVIDIA GPU and no torch yet, whatever
# pip's default index serves; an existing torch is left alone.  Safe to run repeatedly: a stamp
# skips work already done.  MEGAZERO_VENV=DIR uses another virtualenv (the tests use a stub).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
VENV="${MEGAZERO_VENV:-$root/.venv}"
TORCH_CPU=2.13.0                                  # the CPU build CI runs
CPU_INDEX=https://download.pytorch.org/whl/cpu    # PyTorch's index of CPU builds
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp="$VENV/.megazero-installed"
want="$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)"

# pip, its output kept in a log and shown only when it fails: on success a newcomer sees none of
# the warnings a machine's pip configuration or setuptools' editable install print along the way
pip_install() {
  local log
  log="$(mktemp)"
  if "$VPY" -m pip install -q "$@" >"$log" 2>&1; then
    rm -f "$log"
    return 0
  fi
  cat "$log" >&2
  rm -f "$log"
  return 1
}

# DeepSpeed itself, a peer the tests compare the engine with (tests/test_deepspeed_peer.py,
# tests/test_ds_migration.py), in a virtualenv of its own, $VENV/deepspeed: the project venv must not
# import deepspeed (a script changes `import deepspeed` to `import megazero.deepspeed as deepspeed`, and
# the DeepSpeed benchmarks' tests check that a python without it is refused).  It sees this venv's
# packages (torch, transformers) through a .pth line, after its own; DeepSpeed's sdist is built against
# that torch (no build isolation, no ops compiled ahead: DS_BUILD_OPS=0, DS_ACCELERATOR=cpu) with
# --no-deps and its pure-Python dependencies pinned, so pip never resolves a torch.  The ops DeepSpeed
# compiles on first use on CPU (its shared-memory all-reduce, its Adam and its offloaded CPU Adam) are
# built here, into the venv (the tests point TORCH_EXTENSIONS_DIR there).
# Best effort: a failure prints one line and the peer tests skip.  MEGAZERO_DEEPSPEED=0 skips it.
DS_VERSION=0.19.8
DS_STAMP="$DS_VERSION ops:shm_comm,fused_adam,cpu_adam"   # what a finished install holds; a change reinstalls
DS_DEPS=(hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0)
install_deepspeed() {
  local dsv="$VENV/deepspeed" dsstamp="$VENV/deepspeed/.megazero-deepspeed" log purelib
  if [ "${MEGAZERO_DEEPSPEED:-1}" = 0 ] || { [ -f "$dsstamp" ] && [ "$(cat "$dsstamp")" = "$DS_STAMP" ]; }; then
    return 0
  fi
  [ -x "$dsv/bin/python" ] || "$VPY" -m venv --without-pip "$dsv" >/dev/null 2>&1 || true
  if [ ! -x "$dsv/bin/python" ]; then
    echo "setup_env.sh: DeepSpeed (a test peer) not installed: could not create $dsv; its tests skip" >&2
    return 0
  fi
  purelib="$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  "$dsv/bin/python" -c "import sysconfig, sys; open(sysconfig.get_paths()['purelib'] + '/megazero-venv.pth', 'w').write(sys.argv[1] + '\n')" "$purelib"
  log="$(mktemp)"
  if DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$dsv/bin/python" -m pip install -q --no-deps --no-build-isolation \
       "deepspeed==$DS_VERSION" "${DS_DEPS[@]}" >"$log" 2>&1 &&
     DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$dsv/torch_extensions" "$dsv/bin/python" -c \
       "from deepspeed.comm.torch import build_shm_op; from deepspeed.accelerator import get_accelerator as g
build_shm_op(); [g().create_op_builder(n).load() for n in ('FusedAdamBuilder', 'CPUAdamBuilder')]" \
       >>"$log" 2>&1; then
    echo "$DS_STAMP" > "$dsstamp"
  else
    echo "setup_env.sh: DeepSpeed $DS_VERSION (a test peer) not installed into $dsv ($(grep -v '^ *$' "$log" |
         tail -n 1 | cut -c1-200)); its tests skip" >&2
  fi
  rm -f "$log"
}

has_gpu() {  # nvidia-smi -L prints one "GPU i: ..." line per GPU (none, or an error, without one)
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

install_cpu_torch() {
  if [ "$(uname -s)" != Linux ]; then  # macOS and Windows: pip's default index has only CPU builds
    pip_install numpy "torch==$TORCH_CPU"
    return
  fi
  # On Linux the default index (PyPI) serves the CUDA build under the plain version number, so ask
  # for the "+cpu" build by name: from the sources pip is configured with (a local wheel
  # directory, a mirror), else from PyTorch's CPU index.  Neither can yield a CUDA build.
  # numpy with torch: torch warns at import ("Failed to initialize NumPy") while it is missing
  if pip_install numpy "torch==$TORCH_CPU+cpu"; then
    return
  fi
  echo "setup_env.sh: no torch==$TORCH_CPU+cpu among pip's sources; trying $CPU_INDEX" >&2
  if ! pip_install numpy "torch==$TORCH_CPU+cpu" --index-url "$CPU_INDEX"; then
    echo "setup_env.sh: could not install the CPU build torch==$TORCH_CPU+cpu (no NVIDIA GPU here, so" \
         "the CUDA build is not installed); install a CPU build of torch >= 2.6 into $VENV yourself" \
         "(pip install torch --index-url $CPU_INDEX) and run this script again" >&2
    exit 1
  fi
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  install_deepspeed
  exit 0
fi
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if has_gpu; then
    pip_install numpy "torch>=2.6"                # CUDA build from the index
  else
    install_cpu_torch
  fi
fi
# an older torch already here: say so rather than let pip replace it with whatever the index has
if ! "$VPY" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 6))"; then
  echo "setup_env.sh: torch $("$VPY" -c 'import torch; print(torch.__version__)') is older than the 2.6 megazero needs" \
       "(transformers 5 refuses older ones); upgrade it (CPU: pip install torch==$TORCH_CPU+cpu --index-url" \
       "$CPU_INDEX) or use a fresh venv" >&2
  exit 2
fi
pip_install -e ".[test]"
echo "$want" > "$stamp"
install_deepspeed
