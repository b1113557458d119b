"""The installed distribution: every package present, and entry points immune to a foreign `models`.

Builds a wheel of this checkout, installs it alone into a fresh virtual environment (torch and the
other dependencies come from the test's own environment through a path file, so nothing is
downloaded), puts a conflicting top-level ``models`` package beside it and runs the console entry
points from a directory holding another ``models/``, as a user's project would.
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(cmd, cwd, env=None):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(tmp / "dist"), str(ROOT)], cwd=tmp)
    (wheel,) = (tmp / "dist").glob("megazero-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).strip())
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
          str(wheel)], cwd=tmp)
    # another distribution's top-level `models`, installed afterwards: it replaces any `models` there
    shutil.rmtree(site / "models", ignore_errors=True)
    (site / "models").mkdir()
    (site / "models" / "__init__.py").write_text("NOT_MEGAZERO = True\n")
    # dependencies from this environment, without its (editable) megazero
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    project = tmp / "user_project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text("USER_MODELS = True\n")
    return python, project


def _entry_point(python, project, name, *args):
    code = ("import sys; from importlib.metadata import entry_points; "
            f"ep = [e for e in entry_points(group='console_scripts') if e.name == {name!r}][0]; "
            f"sys.exit(ep.load()({list(args)!r}))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    return _run([str(python), "-c", code], cwd=project, env=env)


def test_wheel_holds_every_package(fresh_env):
    python, project = fresh_env
    source = sorted(str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
                    for p in (ROOT / "megazero").rglob("__init__.py"))
    listed = _run([str(python), "-c", "import importlib, sys\n"
                   f"for name in {source + ['megazero_models']!r}: importlib.import_module(name)\n"
                   "import megazero, megazero_models; print(megazero.__file__); "
                   "print(megazero_models.__file__)"],
                  cwd=project)
    assert str(ROOT) not in listed  # imported from the installed wheel, not this checkout


def test_entry_points_ignore_a_foreign_models_package(fresh_env):
    python, project = fresh_env
    out = _entry_point(python, project, "megazero-pretrain", "--mock-data", "--num-layers", "1",
                       "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                       "--vocab-size", "32", "--train-iters", "2", "--log-interval", "1")
    assert "iteration" in out and "2/2" in out
    out = _entry_point(python, project, "megazero-estimate-memory", "--model", "gpt2-small", "--json")
    assert '"total_params"' in out
