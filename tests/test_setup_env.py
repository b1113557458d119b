"""scripts/setup_env.sh picks torch's build from the machine, not from pip's default index: run against
a stub virtualenv (MEGAZERO_VENV) whose ``python`` records every pip call and plays the package
sources, with a stub ``nvidia-smi`` (and ``uname``) on PATH.  Nothing is installed."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# python of the stub venv: "-c 'import torch'" succeeds once a torch is "installed" (the version check
# fails for torch 2.0-2.5); "-m pip install"
# appends its arguments to $FAKE/pip.log; torch==V+cpu is served by the sources named in
# $FAKE_SOURCES ("default": pip's configured sources, "cpu-index": PyTorch's CPU index); a plain
# torch requirement is served by the default index, which on Linux means the CUDA build
STUB_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then
  [ -f "$FAKE/torch" ] || exit 1
  case "$2" in *print*) cat "$FAKE/torch" ;; esac
  case "$2:$(cat "$FAKE/torch")" in *"sys.exit(v < (2, 6))":2.[0-5].*) exit 1 ;; esac
  exit 0
fi
[ "$1 $2 $3" = "-m pip install" ] || exit 0
shift 3
echo "$*" >> "$FAKE/pip.log"
case " $* " in
  *" --upgrade pip "*|*" -e "*) exit 0 ;;
  *"+cpu --index-url https://download.pytorch.org/whl/cpu "*)
    case " $FAKE_SOURCES " in *" cpu-index "*) echo 2.13.0+cpu > "$FAKE/torch"; exit 0 ;; esac
    exit 1 ;;
  *"+cpu "*) case " $FAKE_SOURCES " in *" default "*) echo 2.13.0+cpu > "$FAKE/torch"; exit 0 ;; esac
    exit 1 ;;
  *" torch"*) echo "$FAKE_PLAIN_TORCH" > "$FAKE/torch"; exit 0 ;;
esac
exit 0
"""


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _setup_env(tmp_path, gpus=None, sources="default", system="Linux", torch=None):
    """Run setup_env.sh; ``gpus``: lines `nvidia-smi -L` prints (None: no nvidia-smi; "fail": it
    exits 9 with "No devices were found").  Returns (status, stderr, pip calls, torch installed)."""
    fake, venv, bin_ = tmp_path / "state", tmp_path / "venv", tmp_path / "bin"
    for d in (fake, venv / "bin", bin_):
        d.mkdir(parents=True)
    _stub(venv / "bin" / "python", STUB_PYTHON)
    if gpus == "fail":
        _stub(bin_ / "nvidia-smi", "#!/usr/bin/env bash\necho 'No devices were found'\nexit 9\n")
    elif gpus is not None:
        _stub(bin_ / "nvidia-smi", "#!/usr/bin/env bash\n" + "".join(f"echo '{g}'\n" for g in gpus))
    _stub(bin_ / "uname", f"#!/usr/bin/env bash\necho {system}\n")
    if torch:
        (fake / "torch").write_text(torch + "\n")
    path = os.pathsep.join([str(bin_)] + [p for p in os.environ["PATH"].split(os.pathsep)
                                          if not os.path.exists(os.path.join(p, "nvidia-smi"))])
    env = dict(os.environ, PATH=path, MEGAZERO_VENV=str(venv), FAKE=str(fake), FAKE_SOURCES=sources,
               FAKE_PLAIN_TORCH="2.13.0 (CUDA build)" if system == "Linux" else "2.13.0")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    log = fake / "pip.log"
    calls = [c for c in log.read_text().splitlines() if "--upgrade pip" not in c] if log.exists() else []
    installed = (fake / "torch").read_text().strip() if (fake / "torch").exists() else None
    return out.returncode, out.stderr, calls, installed


@pytest.mark.parametrize("gpus", [None, "fail", []])  # no nvidia-smi; no device; a driver listing none
def test_without_a_gpu_the_cpu_build_comes_from_the_local_sources(tmp_path, gpus):
    code, err, calls, torch = _setup_env(tmp_path, gpus=gpus)
    assert code == 0, err
    assert calls == ["-q numpy torch==2.13.0+cpu", "-q -e .[test]"] and torch == "2.13.0+cpu"
    assert (tmp_path / "venv" / ".megazero-installed").exists()


def test_without_a_gpu_and_without_local_wheels_pytorchs_cpu_index_serves_it(tmp_path):
    """pip's default index would give the CUDA build: it is never asked for a plain torch."""
    code, err, calls, torch = _setup_env(tmp_path, sources="cpu-index")
    assert code == 0, err
    assert calls == ["-q numpy torch==2.13.0+cpu",
                     "-q numpy torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu",
                     "-q -e .[test]"] and torch == "2.13.0+cpu"


def test_when_no_source_has_the_cpu_build_it_stops_rather_than_install_the_cuda_one(tmp_path):
    code, err, calls, torch = _setup_env(tmp_path, sources="")
    assert code == 1 and torch is None and not any("-e" in c for c in calls)
    assert "could not install the CPU build torch==2.13.0+cpu (no NVIDIA GPU here" in err


def test_a_listed_gpu_gets_the_default_index_torch(tmp_path):
    code, err, calls, torch = _setup_env(tmp_path, gpus=["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"])
    assert code == 0, err
    assert calls == ["-q numpy torch>=2.6", "-q -e .[test]"]


def test_off_linux_the_default_index_is_cpu_only(tmp_path):
    code, err, calls, torch = _setup_env(tmp_path, system="Darwin")
    assert code == 0, err
    assert calls == ["-q numpy torch==2.13.0", "-q -e .[test]"]


def test_an_existing_torch_is_left_alone_and_an_old_one_stops_the_script(tmp_path):
    code, err, calls, torch = _setup_env(tmp_path / "a", torch="2.13.0 (CUDA build)")
    assert code == 0 and calls == ["-q -e .[test]"] and torch == "2.13.0 (CUDA build)"
    code, err, calls, torch = _setup_env(tmp_path / "b", torch="2.5.1")
    assert code == 2 and calls == [] and torch == "2.5.1"
    assert "setup_env.sh: torch 2.5.1 is older than the 2.6 megazero needs" in err
