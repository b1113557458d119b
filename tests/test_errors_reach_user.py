"""An engine script's errors reach the user, and its ranks exit cleanly: a megazero error raised after
``initialize`` prints its one line under scripts/launch.py, torchrun and plain python; the process groups
are torn down before the interpreter finalises (no gloo abort at exit); the launcher's own bad arguments
are one line, exit status 2."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "scripts", "launch.py")

# one script, several endings (argv[1]); no init_distributed: initialize() joins the group itself,
# after which torch's excepthook wraps any hook installed before (the case that lost the line)
SCRIPT = textwrap.dedent('''
    import atexit, os, sys
    import torch
    import torch.distributed as dist
    import megazero.deepspeed as deepspeed
    from megazero.errors import ConfigError

    mode, stage = sys.argv[1], int(sys.argv[2])
    atexit.register(lambda: print(f"at exit rank {os.environ.get('RANK', '0')} group alive "
                                  f"{dist.is_initialized()}", flush=True))  # runs after the engine's
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    if mode == "config":
        raise ConfigError("--my-flag 7: not a usable value; give 1 or 2")
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 8, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
    if mode == "corrupt":
        engine.save_checkpoint(sys.argv[3])
        dist.barrier()
        if engine.global_rank == 0:
            with open(sys.argv[3] + "/latest") as fh:
                tag = fh.read().strip()
            for root, _, files in os.walk(os.path.join(sys.argv[3], tag)):
                for name in files:
                    if name.endswith(".bin"):
                        os.truncate(os.path.join(root, name), 100)
        dist.barrier()
        engine.load_checkpoint(sys.argv[3])
    engine.eval()
    with torch.no_grad():
        out = engine(x)
    print(f"rank {engine.global_rank} done {float(out.sum()):.4f}", flush=True)
''')


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    return env


def _run(tmp_path, runner, *args, timeout=300):
    script = tmp_path / "engine_script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable] + runner + [str(script)] + [str(a) for a in args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(tmp_path), timeout=timeout)


LAUNCHERS = {
    "launch.py": [LAUNCH, "--standalone", "--nproc-per-node", "2"],
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "python": [],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_config_error_after_initialize_prints_its_line(tmp_path, launcher):
    run = _run(tmp_path, LAUNCHERS[launcher], "config", 2)
    line = "engine_script.py: error: --my-flag 7: not a usable value; give 1 or 2"
    said = run.stdout + run.stderr
    assert said.count(line) == 1, said[-3000:]
    if launcher != "torchrun":  # torchrun ends with its own traceback and status 1 for any failure
        assert "Traceback" not in said and run.returncode == 2, said[-3000:]
    else:
        assert run.returncode == 1, said[-3000:]


@pytest.mark.slow
def test_a_corrupt_checkpoint_prints_its_line_under_launch(tmp_path):
    run = _run(tmp_path, LAUNCHERS["launch.py"], "corrupt", 2, tmp_path / "ckpt")
    said = run.stdout + run.stderr
    assert run.returncode == 2, said[-3000:]  # an unusable checkpoint: a usage error, as pretrain_gpt.py's
    errors = [line for line in run.stderr.splitlines() if line.startswith("engine_script.py: error: ")]
    assert len(errors) == 1 and "no usable checkpoint" in errors[0] and "truncated" in errors[0], said[-3000:]
    assert "Traceback" not in said


@pytest.mark.slow
def test_two_ranks_exit_cleanly_with_their_groups_destroyed_first(tmp_path):
    """ZeRO-3 with an eval-mode forward last, five times: exit 0, no gloo abort, and the group is gone
    before the interpreter finalises (the script's own atexit function runs after the engine's)."""
    for attempt in range(5):
        run = _run(tmp_path, LAUNCHERS["launch.py"], "eval", 3)
        said = run.stdout + run.stderr
        assert run.returncode == 0 and "terminate called" not in said, f"run {attempt}: {said[-3000:]}"
        # (two ranks print into one pipe at exit: a line's text and its newline may be written apart)
        assert sorted(re.findall(r"at exit rank (\d) group alive (True|False)", run.stdout)) == \
            [("0", "False"), ("1", "False")], run.stdout


def test_the_hook_writes_past_a_hook_that_buffers_stderr(capfd):
    """torch's excepthook swaps sys.stderr for a buffer while it calls the hook it wrapped: ours still
    reaches the process's stderr, and ends the script with the error's status."""
    from megazero.engine.process_exit import ReportUncaught
    from megazero.errors import ConfigError
    seen = []
    ours = ReportUncaught(lambda *a: seen.append(a))

    def buffering(kind, err, tb):
        saved, sys.stderr = sys.stderr, io.StringIO()
        try:
            ours(kind, err, tb)
        finally:
            sys.stderr = saved
    err = ConfigError("--foo 3: give 1 or 2")
    previous = sys.excepthook
    sys.excepthook = buffering
    try:
        with pytest.raises(SystemExit) as ended:
            buffering(type(err), err, None)
    finally:
        sys.excepthook = previous
    assert ended.value.code == 2
    assert ": error: --foo 3: give 1 or 2" in capfd.readouterr().err
    bug = KeyError("x")
    ours(type(bug), bug, None)  # anything else: the hook it replaced
    assert seen == [(KeyError, bug, None)]


def test_teardown_destroys_the_group_and_tolerates_one_already_destroyed(tmp_path):
    import torch.distributed as dist
    from megazero.engine.process_exit import tear_down_process_groups
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    tear_down_process_groups(drain=0)
    assert not dist.is_initialized()
    tear_down_process_groups(drain=0)  # nothing left: no error


@pytest.mark.parametrize("args, flag", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["--nproc-per-node", "many"], "--nproc-per-node: Unsupported nproc_per_node value: many"),
    (["--nnodes", "0"], "--nnodes 0"),
    (["--nnodes", "x"], "--nnodes x"),
    (["--master-port", "70000"], "--master-port 70000"),
    (["--master-port", "abc"], "--master-port"),
    (["--max-restarts", "-1"], "--max-restarts -1"),
    (["--monitor-interval", "0"], "--monitor-interval 0"),
    (["--node-rank", "-1"], "--node-rank -1"),
    (["--rdzv-backend", "nosuch"], "--rdzv-backend nosuch"),
    (["--rdzv-conf", "x"], "--rdzv-conf"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_a_bad_launcher_argument_is_one_line_naming_it(args, flag):
    from megazero.resilience.launch_args import read_launch_args
    parsed, problem = read_launch_args(args + ["train.py"])
    assert parsed is None or problem is not None
    assert flag in problem and "\n" not in problem


def test_good_launcher_arguments_pass():
    from megazero.resilience.launch_args import read_launch_args
    args, problem = read_launch_args(["--standalone", "--nproc-per-node", "2", "train.py", "--x", "1"])
    assert problem is None and args.training_script == "train.py"
    assert args.training_script_args == ["--x", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--standalone", "--nproc-per-node", "0"], ["--rdzv-backend", "nosuch"],
                                  ["--standalone", "--master-port", "abc"]])
def test_launch_py_bad_arguments_exit_2_in_one_line(tmp_path, args):
    run = subprocess.run([sys.executable, LAUNCH] + args + ["train.py"], capture_output=True, text=True,
                         env=_env(), cwd=str(tmp_path), timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1
    assert run.stderr.startswith("launch.py: error: ")
