"""Operations at scale: bounded waits, preemption and time limits, crash recovery, numerical faults,
one message per failure.  Unit tests first; end-to-end runs of pretrain_gpt.py under torchrun are
marked slow (each a few seconds of tiny training on gloo, every process killed in ``finally``)."""
import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from megazero.mesh import ParallelMesh
from megazero.resilience import CollectiveError, ExitSignals, NumericalError, report_failure
from megazero.resilience.faults import FaultInjector, parse_faults
from megazero.resilience.numerics import NanGuard
from megazero.resilience.stop import StopConditions
from megazero.resilience.watchdog import failure_kind
from models.cli import pretrain_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")
RUN_LOCAL = os.path.join(ROOT, "launch", "run_local.sh")
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--optimizer", "sgd", "--lr", "0.1", "--lr-decay-iters", "40", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0"]  # no dropout: layouts compare


def _settings(**extra):
    base = dict(
        mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
        micro_batch_size=1, global_batch_size=4, optimizer="sgd", lr=0.1, lr_decay_iters=40,
        log_interval=100, hidden_dropout=0.0, attention_dropout=0.0)
    return config_from_dict(dict(base, **extra))


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _losses(history):
    return [m["loss"] for m in history]


# ---- flags ------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,needle", [
    (dict(distributed_timeout_minutes=0), "--distributed-timeout-minutes must be > 0"),
    (dict(exit_duration_in_mins=-1.0), "--exit-duration-in-mins must be > 0"),
    (dict(exit_interval=0), "--exit-interval must be a positive integer"),
    (dict(skip_nan_steps=-2), "--skip-nan-steps must be >= 0"),
    (dict(exit_signal=["SIGUSR1"]), "--exit-signal SIGUSR1 needs --exit-signal-handler"),
    (dict(exit_signal_handler=True, exit_signal=["SIGNOPE"]), "--exit-signal SIGNOPE: not a signal"),
])
def test_resilience_flags_are_checked(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(_settings(**changes), 1)


def test_resilience_flags_parse():
    from megazero.config import parse_args
    cfg = parse_args(TINY + ["--distributed-timeout-minutes", "0.5", "--exit-signal-handler", "--exit-signal",
                             "SIGUSR1", "SIGTERM", "--exit-duration-in-mins", "230", "--exit-interval", "100",
                             "--no-check-for-nan-in-loss-and-grad", "--skip-nan-steps", "3"], world_size=1)
    res = cfg.resilience
    got = (res.distributed_timeout_minutes, res.exit_signal, res.exit_duration_in_mins, res.exit_interval,
           res.check_for_nan_in_loss_and_grad, res.skip_nan_steps)
    assert got == (0.5, ["SIGUSR1", "SIGTERM"], 230.0, 100, False, 3)


# ---- pieces -----------------------------------------------------------------------------------
def test_nan_guard_counts_and_names_the_iteration():
    res = validate(_settings(skip_nan_steps=1), 1).resilience
    guard = NanGuard(res, dynamic_scaler=False, precision="bf16")
    assert guard.check(1, 4.2, 1.0, skipped=False) is False
    assert guard.check(2, float("nan"), float("nan"), skipped=True) is True  # one skipped step allowed
    with pytest.raises(NumericalError,
                       match=r"iteration 3: the gradient norm is inf \(bf16\) after 1 skipped"):
        guard.check(3, 4.0, float("inf"), skipped=True)
    dynamic = NanGuard(res, dynamic_scaler=True, precision="fp16")  # gradient overflows: the scaler's
    assert all(dynamic.check(i, 4.0, float("inf"), skipped=True) for i in range(10))
    assert dynamic.check(10, float("nan"), float("nan"), skipped=True) is True  # within --skip-nan-steps 1
    with pytest.raises(NumericalError, match=r"iteration 11: the loss is nan and the gradient norm is nan "
                                             r"\(fp16 with the dynamic loss scaler at 1: a forward loss"):
        dynamic.check(11, float("nan"), float("nan"), skipped=True)
    off = NanGuard(validate(_settings(check_for_nan_in_loss_and_grad=False), 1).resilience, False, "fp32")
    assert all(off.check(i, float("nan"), None, skipped=True) for i in range(10))


def _signal_this_process():
    """In a child process (run_ranks), never the pytest process: SIGUSR1 to itself under ExitSignals."""
    mesh = ParallelMesh.single(torch.device("cpu"))
    res = validate(_settings(exit_interval=3), 1).resilience
    signals = ExitSignals(["SIGUSR1"])
    with signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        seen = (signals.received, StopConditions(res, signals).reason(1, mesh))
    return seen, signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_stop_conditions_interval_duration_and_signal():
    mesh = ParallelMesh.single(torch.device("cpu"))
    res = validate(_settings(exit_interval=3), 1).resilience
    stop = StopConditions(res, None)
    assert [stop.reason(i, mesh) for i in (1, 2, 3)] == [None, None, "--exit-interval 3 reached"]
    late = StopConditions(validate(_settings(exit_duration_in_mins=0.5), 1).resilience, None,
                          started=time.monotonic() - 31)
    assert late.reason(1, mesh) == "--exit-duration-in-mins 0.5 reached"
    [(seen, restored)] = run_ranks(_signal_this_process, 1)
    assert seen == ("SIGUSR1", "SIGUSR1 received (--exit-signal-handler)")
    assert restored  # the handler is put back on leaving


def test_fault_injection_spec():
    assert parse_faults("sigkill@1:6, sigstop@0:3") == [("sigkill", 1, 6), ("sigstop", 0, 3)]
    with pytest.raises(ValueError, match="KIND@RANK:ITERATION"):
        parse_faults("explode@1")
    assert FaultInjector(1, {"MEGAZERO_FAULT": "sigkill@1:6"}).at == {6: "sigkill"}
    assert FaultInjector(1, {"MEGAZERO_FAULT": "sigkill@1:6", "TORCHELASTIC_RESTART_COUNT": "1"}).at == {}


def test_failure_kinds():
    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation"
    assert failure_kind(RuntimeError(gloo)) == "timeout"
    # what a gloo wait raises when its pair was closed by the timeout (seen inside a backward hook)
    assert failure_kind(RuntimeError("Application timeout caused pair closure")) == "timeout"
    closed = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    assert failure_kind(RuntimeError(closed)) == "peer"
    assert failure_kind(torch.distributed.DistBackendError("NCCL communicator was aborted")) == "peer"
    assert failure_kind(RuntimeError("shape mismatch")) is None and failure_kind(ValueError("x")) is None


def test_one_report_per_failure(capsys):
    from megazero.checkpoint import CheckpointError
    assert report_failure(ConfigError("--foo is bad"), rank=0, world_size=2, wait=0) == 2
    assert report_failure(ConfigError("--foo is bad"), rank=1, world_size=2, wait=0) == 2  # rank 0 says it
    # an unusable checkpoint is a usage error wherever it is reported (megazero.errors.exit_status_of)
    assert report_failure(CheckpointError("--load x: missing"), rank=1, world_size=2, wait=0) == 2
    err = capsys.readouterr().err
    assert err == "pretrain_gpt.py: error: --foo is bad\n"
    assert report_failure(CollectiveError("all_reduce timed out"), rank=3, world_size=4, wait=0) == 1
    assert capsys.readouterr().err == "pretrain_gpt.py: error: rank 3: all_reduce timed out\n"
    try:
        {}["bug"]
    except KeyError as bug:
        assert report_failure(bug, rank=2, world_size=4, wait=0) == 1
    assert "Traceback" in capsys.readouterr().err  # a bug keeps its traceback


def _rewrite_error_file(path, stop):
    os.environ["TORCHELASTIC_ERROR_FILE"] = path
    from megazero.resilience.errors import write_error_file
    while not stop.is_set():
        write_error_file("--global-batch-size 8 differs from the last batch size 16")


def test_the_error_file_is_never_seen_half_written(tmp_path):
    """torchrun's agent parses the error file of every rank it ends (torch's ProcessFailure, the reader
    used here), possibly while that rank is writing it: a file rewritten in place was read empty
    (JSONDecodeError inside torchrun, 57 lines, exit 1 instead of the usage error's 2).  A rank
    rewrites its file in a loop while this process reads it as the agent does."""
    import logging
    import multiprocessing
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    path = str(tmp_path / "error.json")
    stop = multiprocessing.get_context("fork").Event()
    writer = multiprocessing.get_context("fork").Process(target=_rewrite_error_file, args=(path, stop))
    writer.start()
    reads, bad = 0, []
    logging.disable(logging.CRITICAL)  # ProcessFailure logs the traceback of a file it cannot parse
    try:
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline or reads < 20:
            if os.path.exists(path):
                reads += 1
                try:
                    failure = ProcessFailure(local_rank=1, pid=writer.pid, exitcode=2, error_file=path)
                    assert failure.message["message"].startswith("--global-batch-size 8 differs")
                except ValueError as err:  # json.JSONDecodeError
                    bad.append(err)
    finally:
        logging.disable(logging.NOTSET)
        stop.set()
        writer.join()
    assert not bad, f"{len(bad)} of {reads} reads found the error file half-written: {bad[0]}"
    assert not [n for n in os.listdir(tmp_path) if n != "error.json"]  # no temporary file left


def test_every_expected_error_has_its_kind_and_resilience_imports_no_subsystem(capsys):
    """The reporter goes by each class's ``kind`` (megazero.errors), so it needs none of the
    subsystems that raise them: megazero.resilience imports no config, checkpoint or precision."""
    from megazero.checkpoint import CheckpointCorrupt
    from megazero.optim.precision import LossScaleError
    from megazero.resilience import DataError
    assert report_failure(LossScaleError("diverged"), rank=0, world_size=1, wait=0) == 1
    # (an unusable checkpoint is a usage error: exit status 2, megazero.errors.exit_status_of)
    assert report_failure(CheckpointCorrupt("x.bin: checksum"), rank=0, world_size=1, wait=0) == 2
    assert report_failure(DataError("token 7 out of range"), rank=1, world_size=2, wait=0) == 1
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: diverged\n"
                                       "pretrain_gpt.py: error: x.bin: checksum\n"
                                       "pretrain_gpt.py: error: rank 1: token 7 out of range\n")
    imported, package = set(), os.path.join(ROOT, "megazero", "resilience")
    for name in (n for n in os.listdir(package) if n.endswith(".py")):
        for node in ast.walk(ast.parse(open(os.path.join(package, name)).read())):  # inside functions too
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
    subsystems = (["megazero", "config"], ["megazero", "checkpoint"], ["megazero", "precision"])
    assert not {m for m in imported if m.split(".")[:2] in subsystems}


# ---- numerical faults, in process ---------------------------------------------------------------
def test_divergence_stops_naming_the_iteration_and_saves_nothing_after(tmp_path):
    d = str(tmp_path / "ckpt")
    with pytest.raises(NumericalError, match=r"iteration 2: the loss is nan and the gradient norm is nan"):
        _train(_settings(optimizer="adam", lr=1e6, train_iters=6, save=d, save_interval=1))
    from megazero.checkpoint import latest_iteration
    assert latest_iteration(d) is None  # iteration 1's weights gave the NaN: never published
    assert os.listdir(d) and "iter_0000001.diverged" in os.listdir(d)
    with pytest.raises(NumericalError, match=r"iteration 1: the gradient norm is nan \(fp16 under the "
                                             r"constant loss scale 1e\+30\)"):
        _train(_settings(fp16=True, loss_scale=1e30, train_iters=3))
    with pytest.raises(NumericalError, match="iteration 4: .* after 2 skipped steps"):
        _train(_settings(optimizer="adam", lr=1e6, train_iters=6, skip_nan_steps=2))


def test_exit_interval_saves_and_the_resume_continues_the_curve(tmp_path):
    d = str(tmp_path / "ckpt")
    ref = _train(_settings(train_iters=5))
    first = _train(_settings(train_iters=5, save=d, exit_interval=2))
    assert [m["iteration"] for m in first] == [1, 2]
    second = _train(_settings(train_iters=5, save=d, load=d))
    assert [m["iteration"] for m in second] == [3, 4, 5]
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=1e-6)


# ---- end to end under torchrun ---------------------------------------------------------------
def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=sys.executable)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGAZERO_FAULT", "NPROC",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(key, None)
    env.update(extra)
    return env


def _children(pid):
    """Every descendant of ``pid`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


class Launch:
    """A launcher process (own session) whose output goes to ``log``; everything it started is killed
    on exit (torchrun starts each rank in a session of its own)."""

    def __init__(self, cmd, env, log, cwd):
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.known = set()

    def text(self):
        return open(self.log, errors="replace").read()

    def wait_for(self, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.known.update(_children(self.proc.pid))
            match = re.search(pattern, self.text())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in the output:\n{self.text()[-4000:]}")

    def wait(self, timeout):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.text()[-4000:]}") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for pid in set(_children(self.proc.pid)) | self.known | {self.proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait()


def _torchrun(nproc, *flags, extra=()):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *extra, SCRIPT, *TINY, *flags]


def _metrics(path):
    """The last record of each iteration (a restarted run repeats some)."""
    out = {}
    for line in open(path):
        m = json.loads(line)
        out[m["iteration"]] = m
    return out


@pytest.mark.slow
def test_preemption_signal_saves_exits_0_and_the_resume_continues(tmp_path):
    """SIGUSR1 to every process of the job, as SLURM's --signal does; the agent ignores it, as in
    launch/slurm.sbatch."""
    d, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    cmd = ["bash", "-c", 'trap "" USR1; exec "$@"', "agent"] + _torchrun(
        2, "--train-iters", "40", "--zero-stage", "2", "--save", d, "--exit-signal-handler", "--exit-signal",
        "SIGUSR1", "SIGTERM", "--metrics-file", metrics)
    with Launch(cmd, _env(), str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +3/40", 180)
        for pid in _children(run.proc.pid) + [run.proc.pid]:
            os.kill(pid, signal.SIGUSR1)
        assert run.wait(120) == 0, run.text()[-3000:]
    out = run.text()
    stop = re.search(r"stopping after iteration (\d+): SIGUSR1 received", out)
    assert stop and out.count("stopping after iteration") == 1, out[-3000:]
    n = int(stop.group(1))
    assert f"saved checkpoint at iteration {n} " in out and n < 40
    first = [m for _, m in sorted(_metrics(metrics).items())]
    second = _train(_settings(train_iters=n + 2, load=d))  # one process: the DP 2 checkpoint resharded
    ref = _train(_settings(train_iters=n + 2))
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=2e-6, abs=1e-6)


@pytest.mark.slow
def test_kill_9_of_a_rank_restarts_with_the_same_curve_and_fewer_ranks_resume(tmp_path, capfd):
    """launch/run_local.sh --max-restarts 1: rank 1 is killed at iteration 6 (saves every 2; iteration
    4's save is published once iteration 5's loss checks out), the job restarts from iteration 4 and
    every logged loss equals the uninterrupted run's.  Then the same directory resumes with one process
    instead of two (DP 2 -> 1, same global batch)."""
    d, metrics, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl"), str(tmp_path / "run")
    cmd = ["bash", RUN_LOCAL, "--max-restarts", "1", "--run-dir", run_dir, "--", *TINY, "--train-iters", "8",
           "--save", d, "--load", d, "--save-interval", "2", "--metrics-file", metrics, "--zero-stage", "2"]
    env = _env(NPROC="2", MEGAZERO_FAULT="sigkill@1:6")
    with Launch(cmd, env, str(tmp_path / "out.log"), str(tmp_path)) as run:
        assert run.wait(300) == 0, run.text()[-3000:]
    out = run.text()
    assert "loaded checkpoint" in out and "iter_0000004 (iteration 4" in out
    attempts = {p.split(os.sep)[-2] for p, _, files in os.walk(run_dir) if "stderr.log" in files}
    assert attempts == {"attempt_0", "attempt_1"}  # per-rank logs of both attempts
    got = _metrics(metrics)
    assert set(range(5, 9)) <= set(got)
    ref = _train(_settings(train_iters=10))
    for it, m in got.items():  # every iteration logged equals the uninterrupted run's
        assert m["loss"] == pytest.approx(ref[it - 1]["loss"], rel=2e-6, abs=1e-6), it

    capfd.readouterr()  # one process (forked) resumes the DP 2 checkpoint
    argv = TINY + ["--train-iters", "10", "--save", d, "--load", d, "--metrics-file", metrics]
    assert run_ranks(pretrain_main, 1, argv, timeout=300) == [0]
    assert "(iteration 8, 32 samples; saved under tp 1 pp 1 dp 2 zero 2" in capfd.readouterr().out
    got = _metrics(metrics)
    assert [got[i]["loss"] for i in (9, 10)] == pytest.approx(_losses(ref[8:]), rel=2e-6, abs=1e-6)


@pytest.mark.slow
def test_ranks_exit_when_their_launcher_is_killed(tmp_path):
    cmd = _torchrun(2, "--train-iters", "100000")
    with Launch(cmd, _env(), str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +2/100000", 180)
        ranks = _children(run.proc.pid)
        assert len(ranks) == 2
        os.kill(run.proc.pid, signal.SIGKILL)  # the torchrun agent
        run.proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and _state(p) != "Z"
                                                  for p in ranks):
            time.sleep(0.2)
        alive = [p for p in ranks if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]
        assert not alive, "orphans kept running"


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
def test_a_usage_error_is_one_line_and_status_2_in_every_launch(tmp_path):
    """A usage error (Megatron-LM's --global-batch-size with a --step-batch-size-schedule that ends
    elsewhere) under scripts/launch.py with 8 ranks: exit status 2 and one line, rank 0's message.
    Rank 0 prints it; the others wait for the launcher, so the message never vanishes (it used to in
    2 of 31 launches); torchrun's agent parses the error file of every rank it ends, which a rank
    must never leave half-written (it crashed the agent with a JSONDecodeError, 3 launches in 3).
    One launch in the suite; MEGAZERO_BAD_FLAG_LAUNCHES=N runs N, two at a time (10 to show the
    race gone, 30 to look for a rare loss)."""
    launches = int(os.environ.get("MEGAZERO_BAD_FLAG_LAUNCHES", "1"))
    flags = ["--global-batch-size", "8", "--step-batch-size-schedule", "0:8 100:16"]
    needle = ("pretrain_gpt.py: error: --global-batch-size 8 differs from the last batch size 16 of "
              "--step-batch-size-schedule")
    launcher = [sys.executable, os.path.join(ROOT, "scripts", "launch.py"), "--standalone",
                "--nproc-per-node", "8", SCRIPT, *TINY, "--train-iters", "3"]
    done = 0
    while done < launches:
        batch = min(2, launches - done)
        runs = [Launch(launcher + flags, _env(), str(tmp_path / f"{done + i}.log"), str(tmp_path))
                for i in range(batch)]
        try:
            for i, run in enumerate(runs):
                code = run.wait(300)
                lines = run.text().splitlines()
                assert code == 2 and len(lines) == 1 and lines[0].startswith(needle), \
                    f"launch {done + i}: status {code}\n" + "\n".join(lines[-40:])
        finally:
            for run in runs:
                run.__exit__(None, None, None)
        done += batch
