"""Operations II: divergence never becomes the checkpoint to resume from, one voice under the launcher,
preemption that always saves, fine-tunes that resume, asynchronous saves, pruning.  End-to-end runs
reuse the torchrun harness of test_operations.py (every process killed in ``finally``)."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from megazero.checkpoint import latest_iteration
from megazero.config import ConfigError, validate
from megazero.process.local_ranks import run_ranks
from megazero.resilience import NumericalError
from megazero.resilience.numerics import LossSpikeGuard
from models.cli import pretrain_main
from tests.sockets import listening
from tests.test_operations import (ROOT, SCRIPT, TINY, Launch, _children, _env, _losses, _metrics, _settings,
                                   _train)

LAUNCH = os.path.join(ROOT, "scripts", "launch.py")


# ---- divergence ------------------------------------------------------------------------------
def test_loss_spike_guard_and_its_flags():
    guard = LossSpikeGuard(3.0, window=3)
    for it, loss in enumerate([5.0, 4.0, 4.5, 4.2], 1):
        guard.check(it, loss)
    guard.check(5, float("nan"))  # non-finite: the NaN guard's business, not a spike
    with pytest.raises(NumericalError, match=r"iteration 6: the loss 13 is over --loss-spike-factor 3 times "
                                             r"the median 4.2 of the last 3 losses"):
        guard.check(6, 13.0)  # median of the last 3 (4.0, 4.5, 4.2) is 4.2: 13 > 12.6
    LossSpikeGuard(None, 3).check(1, 1e30)  # off
    off = LossSpikeGuard(0.0, 3)  # --loss-spike-factor 0: off
    for it, loss in enumerate([5.0, 1e30], 1):
        off.check(it, loss)
    off_too = r"--loss-spike-factor must be > 1 .* or 0 \(off\)"
    for changes, needle in ((dict(loss_spike_factor=1.0), off_too),
                            (dict(loss_spike_window=0), "--loss-spike-window must be a positive integer"),
                            (dict(loss_spike_factor=3.0, loss_spike_action="retry"),
                             "--loss-spike-action must be stop or skip, got 'retry'"),
                            (dict(loss_spike_factor=3.0, loss_spike_max_skips=0),
                             "--loss-spike-max-skips must be a positive integer"),
                            (dict(loss_spike_action="skip", loss_spike_factor=0.0),
                             "--loss-spike-action skip needs --loss-spike-factor K > 1"),
                            (dict(ckpt_keep=0, save="x"), "--ckpt-keep must be a positive integer"),
                            (dict(ckpt_keep=2), "--ckpt-keep needs --save"),
                            (dict(async_save=True), "--async-save needs --save"),
                            (dict(pretrained_checkpoint="p", finetune=True, load="x"),
                             "--pretrained-checkpoint already loads weights only")):
        with pytest.raises(ConfigError, match=needle):
            validate(_settings(**changes), 1)


def test_fp16_nan_forward_loss_exits_non_zero_and_the_tracker_names_the_last_good(tmp_path):
    """fp16 with the dynamic scaler, a huge learning rate (warmed up): the forward loss turns NaN at
    iteration 5.  The run exits 1 (it used to "skip" and save each step); iteration 4's save, whose
    weights gave the NaN, is set aside; the tracker names iteration 3, and resuming from it is finite."""
    d = str(tmp_path / "ckpt")
    flags = [f for f in TINY if f not in ("--lr", "0.1")]
    cmd = [sys.executable, SCRIPT, *flags, "--lr", "1000", "--lr-warmup-iters", "6", "--fp16",
           "--initial-loss-scale", "64", "--train-iters", "8", "--save", d, "--save-interval", "1",
           "--loss-spike-factor", "0"]  # the NaN guard alone (the spike guard would stop it sooner)
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr
    assert re.search(r"error: iteration 5: the loss is nan .*fp16 with the dynamic loss scaler", err), err
    assert "The last good checkpoint is iteration 3 in " in err, err
    assert "iter_0000004.diverged" in err and "Traceback" not in err
    assert latest_iteration(d) == 3
    resumed = _train(_settings(fp16=True, lr=1000.0, lr_warmup_iters=6, initial_loss_scale=64.0,
                               train_iters=4, load=d))
    assert [m["iteration"] for m in resumed] == [4] and all(x == x for x in _losses(resumed))


def test_fp32_finite_spike_stops_and_the_tracker_names_the_last_good(tmp_path):
    """fp32, SGD warmed up to a learning rate that diverges with finite losses (4.6 -> 14.7 at
    iteration 4): --loss-spike-factor 3 stops there; the tracker names iteration 2, not 3."""
    d = str(tmp_path / "ckpt")
    settings = dict(lr=30.0, lr_warmup_iters=6, loss_spike_factor=3.0, save=d, save_interval=1)
    spike = r"iteration 4: the loss [\d.]+ is over --loss-spike-factor 3"
    with pytest.raises(NumericalError, match=spike) as e:
        _train(_settings(train_iters=8, **settings))
    assert "The last good checkpoint is iteration 2 in " in str(e.value)
    assert latest_iteration(d) == 2 and "iter_0000003.diverged" in os.listdir(d)
    ref = _train(_settings(train_iters=3, lr=30.0, lr_warmup_iters=6))
    resumed = _train(_settings(train_iters=3, lr=30.0, lr_warmup_iters=6, load=d))
    assert _losses(resumed) == pytest.approx(_losses(ref)[2:], rel=1e-6)  # iteration 3 replays, finite


def test_the_guard_is_on_by_default_and_zero_turns_it_off(tmp_path):
    """No flag: an fp32 run at --lr 50 explodes (4.6, 27, ..., 1470 at iteration 4) and stops at
    iteration 4 under the default --loss-spike-factor 10 (1470 > 10 x the median 27), the save whose
    weights gave it set aside; with --loss-spike-factor 0 the same run finishes and publishes its last
    checkpoint (the old default: exploded weights saved, exit status 0)."""
    d = str(tmp_path / "ckpt")
    with pytest.raises(NumericalError, match=r"iteration 4: the loss [\d.]+ is over --loss-spike-factor 10 "):
        _train(_settings(train_iters=6, lr=50.0, save=d, save_interval=1))
    assert latest_iteration(d) == 2 and "iter_0000003.diverged" in os.listdir(d)
    off = _train(_settings(train_iters=6, lr=50.0, loss_spike_factor=0.0, save=str(tmp_path / "off")))
    assert len(off) == 6 and off[3]["loss"] > 100 * off[0]["loss"]  # it did explode
    assert latest_iteration(str(tmp_path / "off")) == 6


def _spikes_at(monkeypatch, iterations):
    """The loss agreed before the update (``_mean_loss``, once per step with --loss-spike-action skip)
    reads 100 times higher at ``iterations``: a spiking batch, produced deterministically."""
    import megazero.training.loop as training
    real, calls = training._mean_loss, []

    def spiky(losses, mesh):
        calls.append(1)
        return real(losses, mesh) * (100.0 if len(calls) in iterations else 1.0)
    monkeypatch.setattr(training, "_mean_loss", spiky)


def test_a_skipped_spike_leaves_every_weight_bitwise_unchanged_and_training_goes_on(tmp_path, monkeypatch):
    """--loss-spike-action skip, Adam: the spiking batch of iteration 4 is not applied (the weights
    saved after it are bitwise those after iteration 3 of a run without it), the learning-rate
    schedule does not advance, it counts as skipped, and iterations 5-6 train on with finite losses;
    two spikes in a row with --loss-spike-max-skips 1 stop the run, naming the flag."""
    guard = dict(optimizer="adam", lr=1e-3, loss_spike_factor=3.0, loss_spike_action="skip")
    ref = _train(_settings(train_iters=3, optimizer="adam", lr=1e-3, save=str(tmp_path / "ref")))
    _spikes_at(monkeypatch, {4})
    skipped = _train(_settings(train_iters=4, save=str(tmp_path / "skip"), **guard))
    before, after = _weights(str(tmp_path / "ref")), _weights(str(tmp_path / "skip"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert [m["skipped"] for m in skipped] == [0, 0, 0, 1] and skipped[3]["skipped_total"] == 1
    _spikes_at(monkeypatch, {4})
    goes_on = _train(_settings(train_iters=6, **guard))
    assert [m["skipped"] for m in goes_on] == [0, 0, 0, 1, 0, 0]
    assert goes_on[4]["lr"] == goes_on[3]["lr"] != goes_on[2]["lr"]  # the schedule waited one step
    assert all(math.isfinite(m["loss"]) and m["loss"] < 3 * ref[2]["loss"] for m in goes_on[4:])
    _spikes_at(monkeypatch, {4, 5})
    with pytest.raises(NumericalError, match=r"iteration 5: the loss [\d.]+ is over --loss-spike-factor 3 .*"
                                             r"after 1 spiking batches in a row were skipped "
                                             r"\(--loss-spike-max-skips 1\)"):
        _train(_settings(train_iters=6, loss_spike_max_skips=1, **guard))


# ---- one voice --------------------------------------------------------------------------------
def _launch(nproc, *flags, extra=()):
    return [sys.executable, LAUNCH, "--standalone", "--nproc-per-node", str(nproc), *extra, SCRIPT, *TINY,
            *flags]


@pytest.mark.slow
def test_an_unknown_flag_under_4_ranks_prints_at_most_5_lines(tmp_path):
    """Rank 0 alone prints the usage line and the error; the launcher adds nothing (status 2)."""
    with Launch(_launch(4, "--train-iter", "3"), _env(), str(tmp_path / "out.log"), str(tmp_path)) as run:
        assert run.wait(300) == 2, run.text()[-3000:]
    lines = run.text().splitlines()
    assert len(lines) <= 5, "\n".join(lines)
    assert sum("unrecognized arguments: --train-iter 3" in line for line in lines) == 1  # no abbreviation


# ---- preemption -------------------------------------------------------------------------------
def _weights(directory):
    from megazero.checkpoint import read_weights
    return read_weights(directory)[3]


@pytest.mark.slow
def test_sigterm_to_the_launcher_and_every_rank_saves_once_exits_0_and_resumes_bitwise(tmp_path):
    """SLURM's preemption: SIGTERM to the launcher and all 4 ranks at once (each rank also gets the
    launcher's forwarded copy).  One save, exit 0 with one launcher line, no traceback; resuming under
    the same layout gives bitwise the losses and weights of an uninterrupted run."""
    d, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    flags = ["--global-batch-size", "8", "--zero-stage", "1", "--exit-signal-handler"]
    cmd = _launch(4, *flags, "--train-iters", "1000", "--save", d, "--metrics-file", metrics)
    with Launch(cmd, _env(), str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +3/1000", 300)
        pids = [run.proc.pid] + _children(run.proc.pid)
        assert len(pids) == 5, pids
        stores = listening(run.proc.pid)  # the agent's stores: on 127.0.0.1 only (torchrun: every interface)
        assert stores and all(addr == "127.0.0.1" for addr, _ in stores), stores
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        assert run.wait(300) == 0, run.text()[-3000:]
    out = run.text()
    stop = re.search(r"stopping after iteration (\d+): SIGTERM received", out)
    assert stop and out.count("stopping after iteration") == 1, out[-3000:]
    n = int(stop.group(1))
    assert out.count("saved checkpoint at iteration") == 1 and f"saved checkpoint at iteration {n} " in out
    assert "Traceback" not in out and "error" not in out.lower(), out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("launch.py: SIGTERM received: every rank stopped cleanly")
    assert latest_iteration(d) == n
    end = n + 2  # the resume and the uninterrupted run: the same 4 ranks, forked (no torch imports)
    argv = TINY + flags + ["--train-iters", str(end)]
    assert run_ranks(pretrain_main, 4, argv + ["--load", d, "--save", d, "--metrics-file", metrics],
                     timeout=300) == [0] * 4
    ref, ref_metrics = str(tmp_path / "ref"), str(tmp_path / "ref.jsonl")
    assert run_ranks(pretrain_main, 4, argv + ["--save", ref, "--metrics-file", ref_metrics],
                     timeout=300) == [0] * 4
    got, want = _metrics(metrics), _metrics(ref_metrics)
    assert [got[i]["loss"] for i in range(1, end + 1)] == [want[i]["loss"] for i in range(1, end + 1)]
    mine, theirs = _weights(d), _weights(ref)
    assert mine.keys() == theirs.keys() and all(mine[k].equal(theirs[k]) for k in mine)


@pytest.mark.slow
def test_kill_9_of_the_agent_still_saves(tmp_path):
    """The agent (launch/run_local.sh: scripts/launch.py with per-rank log files) is killed with
    SIGKILL: its ranks learn it from the kernel (parent death signal), save once and exit."""
    d, run_dir = str(tmp_path / "ckpt"), str(tmp_path / "run")
    cmd = ["bash", os.path.join(ROOT, "launch", "run_local.sh"), "--run-dir", run_dir, "--", *TINY,
           "--train-iters", "100000", "--save", d, "--exit-signal-handler"]
    with Launch(cmd, _env(NPROC="2"), str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +3/100000", 300)
        ranks = _children(run.proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(run.proc.pid, signal.SIGKILL)  # run_local.sh execs the launcher: this is the agent
        run.proc.wait()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks), "orphans kept running"
    logs = [os.path.join(p, f) for p, _, files in os.walk(run_dir) for f in files if f.endswith(".log")]
    out = "".join(open(f, errors="replace").read() for f in sorted(logs))  # the console died with the agent
    stop = re.search(r"stopping after iteration (\d+): SIGTERM received", out)
    assert stop, out[-3000:]
    assert latest_iteration(d) == int(stop.group(1)), out[-3000:]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_ranks_exit_when_the_agent_died_before_they_started(tmp_path):
    """A rank whose agent is already gone when it starts (MEGAZERO_AGENT_PID names a process that is
    not its parent) ends itself at once instead of waiting in the rendezvous."""
    env = _env(MEGAZERO_AGENT_PID="1", TORCHELASTIC_RUN_ID="x", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="9")  # nothing listens there: it would wait
    start = time.monotonic()
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--train-iters", "3"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert time.monotonic() - start < 60


# ---- fine-tunes resume ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_fine_tune_resumes_its_own_progress_under_max_restarts(tmp_path):
    """--pretrained-checkpoint P --save F --load F: the first attempt starts from P's weights at
    iteration 0; rank 1 is killed at iteration 6 and the restart (torchrun --max-restarts 1) resumes
    from F's iteration 4, not from P; every logged loss equals an uninterrupted fine-tune's.
    --finetune keeps Megatron-LM's meaning: --load's weights from iteration 0, on every start."""
    pre, ft, metrics = str(tmp_path / "pre"), str(tmp_path / "ft"), str(tmp_path / "m.jsonl")
    _train(_settings(train_iters=3, save=pre))
    ref = _train(_settings(train_iters=8, pretrained_checkpoint=pre))
    scratch = _train(_settings(train_iters=8))
    assert _losses(ref)[0] != pytest.approx(_losses(scratch)[0], rel=1e-3)  # the weights did come from P
    cmd = ["bash", os.path.join(ROOT, "launch", "run_local.sh"), "--max-restarts", "1", "--run-dir",
           str(tmp_path / "run"), "--", *TINY, "--train-iters", "8", "--pretrained-checkpoint", pre,
           "--save", ft, "--load", ft, "--save-interval", "2", "--metrics-file", metrics]
    with Launch(cmd, _env(NPROC="2", MEGAZERO_FAULT="sigkill@1:6"), str(tmp_path / "out.log"),
                str(tmp_path)) as run:
        assert run.wait(300) == 0, run.text()[-3000:]
    out = run.text()
    assert "(it is also --save): fine-tuning from --pretrained-checkpoint" in out
    assert "weights of iteration 3 for fine-tuning from iteration 0" in out
    assert re.search(r"loaded checkpoint \S*ft/iter_0000004 \(iteration 4, 16 samples", out), out[-3000:]
    got = _metrics(metrics)
    assert sorted(got) == list(range(1, 9))
    assert [got[i]["loss"] for i in range(1, 9)] == pytest.approx(_losses(ref), rel=2e-6, abs=1e-6)
    again = _train(_settings(train_iters=2, load=ft, finetune=True))  # Megatron's --finetune: iteration 0
    assert [m["iteration"] for m in again] == [1, 2]


# ---- asynchronous saves ------------------------------------------------------------------------
def _files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


@pytest.mark.slow
def test_async_save_writes_the_same_bytes_and_a_failed_one_keeps_the_previous(tmp_path, monkeypatch):
    import json
    sync, asyn = str(tmp_path / "sync"), str(tmp_path / "async")
    settings = dict(optimizer="adam", lr=0.01, train_iters=5, save_interval=2, zero_stage=1)
    ref = _train(_settings(save=sync, **settings))
    from megazero.checkpoint import background
    copy = background.Snapshot.copy

    def slow_copy(snapshot):  # the next step's update must wait for the copy, or the bytes would differ
        time.sleep(0.5)
        copy(snapshot)
    monkeypatch.setattr(background.Snapshot, "copy", slow_copy)
    got = _train(_settings(save=asyn, async_save=True, **settings))
    monkeypatch.undo()
    assert _losses(got) == _losses(ref)  # training unaffected, bitwise
    for it in ("iter_0000002", "iter_0000004", "iter_0000005"):
        a, b = _files(os.path.join(sync, it)), _files(os.path.join(asyn, it))
        assert a.keys() == b.keys()
        for name in a:
            if name.endswith((".bin", ".pt")):
                assert a[name] == b[name], (it, name)  # data and generator states: the same bytes
            elif name.startswith("shard_"):  # the index: the same but for the run id
                ia, ib = (dict(json.loads(x[name]), run_id=None) for x in (a, b))
                assert ia == ib, (it, name)
        ma, mb = (json.loads(x["metadata.json"]) for x in (a, b))
        for m in (ma, mb):  # what differs by design: the run id (in the .json files), the config's --save
            for key in ("run_id", "checksum"):
                m.pop(key, None)
            m["files"] = {k: v for k, v in m["files"].items() if not k.endswith(".json")}
        assert ma == mb
    assert latest_iteration(asyn) == 5

    from megazero.checkpoint import shards
    real = shards.write_rank_shard

    def full_disk(directory, *args):
        if "iter_0000004" in directory:
            raise OSError(28, "No space left on device")
        return real(directory, *args)
    monkeypatch.setattr(shards, "write_rank_shard", full_disk)
    failed = str(tmp_path / "failed")
    with pytest.raises(Exception, match="iter_0000004.tmp: no space left on device"):
        _train(_settings(save=failed, async_save=True, **settings))
    assert latest_iteration(failed) == 2
    assert sorted(n for n in os.listdir(failed) if n.startswith("iter_")) == ["iter_0000002"]
    monkeypatch.undo()
    resumed = _train(_settings(load=failed, **dict(settings, save_interval=0)))
    assert _losses(resumed) == _losses(ref)[2:]


# ---- pruning, tools that say which checkpoint they use, all-corrupt directories ----------------
def _flip(path):
    with open(path, "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
def test_ckpt_keep_tools_name_the_iteration_they_use_and_an_all_corrupt_dir_lists_each(tmp_path, capsys):
    import importlib.util
    from megazero.checkpoint import CheckpointCorrupt, CheckpointError
    d = str(tmp_path / "ckpt")
    _train(_settings(train_iters=4, save=d, save_interval=1, ckpt_keep=2))
    assert sorted(n for n in os.listdir(d) if n.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    assert latest_iteration(d) == 4
    _flip(os.path.join(d, "iter_0000004", "shard_tp00_pp000_dp000.bin"))
    script = os.path.join(ROOT, "scripts", "generate.py")
    spec = importlib.util.spec_from_file_location("generate_script", script)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    capsys.readouterr()
    assert gen.main(["--load", d, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"generate.py: using iteration 3 \(\S+iter_0000003\), not the newest: skipped "
                     r".*iter_0000004.*shard_tp00_pp000_dp000.bin", err), err
    _flip(os.path.join(d, "iter_0000003", "shard_tp00_pp000_dp000.bin"))
    with pytest.raises(CheckpointCorrupt) as e:
        _train(_settings(train_iters=5, load=d))
    text = str(e.value)
    assert "each one failed: iteration 4: " in text and "iteration 3: " in text, text
    with open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("-1\n")
    with pytest.raises(CheckpointError, match="expected an iteration number, found '-1'"):
        latest_iteration(d)


# ---- the stall diagnosis names the stopped rank, whatever group timed out ------------------------
@pytest.mark.slow
def test_the_stall_diagnosis_names_a_stopped_rank_outside_the_failing_group(tmp_path):
    """4 ranks, TP 2 (TP groups [0, 1] [2, 3], DP groups [0, 2] [1, 3]); ranks 2 and 3 are stopped at
    iteration 3.  Ranks 0 and 1 finish their forward and backward and block in the gradient
    all-reduce, rank 0 with rank 2 and rank 1 with rank 3; whichever times out first prints a message
    that also names the stopped rank outside its failing group (torchrun may end the other before it
    prints), and the launcher's line leads with a stopped rank."""
    cmd = _launch(4, "--train-iters", "200", "--tensor-model-parallel-size", "2",
                  "--distributed-timeout-minutes", "0.15")
    timeout_s = 9.0
    fault = _env(MEGAZERO_FAULT="sigstop@2:3,sigstop@3:3")
    with Launch(cmd, fault, str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +2/200", 300)
        start = time.monotonic()
        run.wait_for(r"pretrain_gpt.py: error: rank [01]: (.*)", timeout_s + 90)
        elapsed = time.monotonic() - start
        time.sleep(3)  # the other rank's message, if it gets to print one
        for pid in run.known:  # the stopped ranks cannot act on the launcher's SIGTERM: end them
            os.kill(pid, signal.SIGKILL) if os.path.exists(f"/proc/{pid}") else None
        assert run.wait(120) != 0
    errors = re.findall(r"pretrain_gpt.py: error: rank (\d): (.*)", run.text())
    assert errors and {r for r, _ in errors} <= {"0", "1"}, run.text()[-3000:]
    assert len({r for r, _ in errors}) == len(errors)  # one message per rank
    for rank, message in errors:
        mine, other = (2, 3) if rank == "0" else (3, 2)  # the stopped rank in its DP group, the other
        if hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json"):  # the flight recorder names the op
            group = rf"^all_reduce on the data-parallel group \(ranks \[{rank}, {mine}\]\) timed out"
            assert re.search(group, message), message
        else:  # no flight recorder in this torch (2.6 and older): the operation is not known
            unnamed = r"^a collective or point-to-point operation timed out at iteration 3"
            assert re.search(unnamed, message), message
        assert "after 9 s (--distributed-timeout-minutes 0.15)" in message
        assert re.search(rf"rank {mine} \(pid \d+ on [^)]*\) has stopped", message), message
        outside = rf"rank {other} \(pid \d+ on [^)]*, outside this group\) has stopped"
        assert re.search(outside, message), message
    assert elapsed < timeout_s + 60, elapsed  # bounded: the timeout plus start-up slack on a loaded machine
    last = run.text().rstrip().splitlines()[-1]  # the launcher's line names a stopped rank first
    assert re.match(r"launch.py: pretrain_gpt.py: rank ([23]) stopped responding \(rank [01]'s diagnosis: "
                    r"rank \1 \(pid \d+ on [^)]*\) has stopped\); rank [0-3] ", last), last


def test_the_launcher_line_names_the_stopped_rank_from_the_error_files(tmp_path, monkeypatch):
    """Each failed rank's message goes to torchrun's error file; the launcher's line leads with the
    rank the diagnosis names (not with the healthy rank that failed first), and without a stall
    it is the plain line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from megazero.resilience import CollectiveError, report_failure
    from megazero.resilience.launcher import failure_line
    said = ("all_reduce on the world group (ranks [0, 1, 2]) timed out. Not answering: rank 2 (pid 7 on vm) "
            "has stopped; rank 0 (pid 5 on vm) has exited. Look at that rank's log first.")
    files = {r: str(tmp_path / f"error{r}.json") for r in range(3)}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[1])
    assert report_failure(CollectiveError(said), rank=1, world_size=3, wait=0) == 1
    failures = {1: ProcessFailure(1, 11, 1, files[1]), 2: ProcessFailure(2, 12, -9, files[2])}
    line = failure_line(ChildFailedError("pretrain_gpt.py", failures))
    assert line == ("rank 2 stopped responding (rank 1's diagnosis: rank 2 (pid 7 on vm) has stopped); "
                    "rank 1 exited with status 1 first (1 other rank also failed); its messages are above")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[0])
    report_failure(CollectiveError("all_reduce timed out. Not answering: rank 1 (pid 6 on vm) has exited. "
                                   "Look at that rank's log first."), rank=0, world_size=3, wait=0)
    line = failure_line(ChildFailedError("pretrain_gpt.py", {0: ProcessFailure(0, 10, 1, files[0])}))
    assert line == "rank 0 exited with status 1 first; its messages are above"  # an exited rank failed itself


class _DiskFillsAt:
    """A metrics file on a disk that fills during write number ``at``: that write puts ``room`` bytes
    of its row on disk, then fails with ENOSPC (a row cut short, no newline), as a full disk does."""

    def __init__(self, fh, at, room=40):
        self.fh, self.at, self.room, self.writes = fh, at, room, 0

    def write(self, text):
        self.writes += 1
        if self.writes < self.at:
            return self.fh.write(text)
        self.fh.write(text[:self.room] if self.writes == self.at else "")
        self.fh.flush()
        raise OSError(28, "No space left on device")

    def flush(self):
        self.fh.flush()

    def close(self):
        self.fh.close()


def _read_metrics(path):
    """scripts/plot_metrics.py's reader (raises on a line that is not JSON)."""
    import importlib.util
    script = os.path.join(ROOT, "scripts", "plot_metrics.py")
    spec = importlib.util.spec_from_file_location("plot_metrics", script)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.read_metrics(path)


def test_a_full_metrics_disk_stops_with_one_line_and_an_emergency_save_and_the_resume_repairs_the_file(
        tmp_path, monkeypatch):
    """The disk fills while iteration 3's row is written: the row is cut short (no newline), the run
    stops with one line and an emergency save at iteration 3.  The resume repairs the file (the cut
    row goes; iteration 3's row, kept in the checkpoint, is written whole) and appends after it:
    plot_metrics.py reads every iteration once, with the losses of an uninterrupted run."""
    from megazero.resilience import FatalError
    from megazero.training.log import TrainingLogger
    real_open = TrainingLogger._open_metrics

    def open_on_a_filling_disk(self, *args):
        real_open(self, *args)
        self.metrics_fh = _DiskFillsAt(self.metrics_fh, at=3)
    monkeypatch.setattr(TrainingLogger, "_open_metrics", open_on_a_filling_disk)
    d, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    needle = (r"--metrics-file \S+m.jsonl: no space left on device \(errno 28\) at iteration 3; stopped with "
              r"an emergency save \(saved checkpoint at iteration 3")
    with pytest.raises(FatalError, match=needle):
        _train(_settings(train_iters=6, save=d, save_interval=5, metrics_file=metrics))
    text = open(metrics).read()
    assert latest_iteration(d) == 3 and text.count("\n") == 2 and text.endswith(text.splitlines()[2])
    with pytest.raises(ValueError, match="m.jsonl:3: not a JSON line"):
        _read_metrics(metrics)  # what the file looked like before it was repaired on resume
    monkeypatch.undo()
    resumed = _train(_settings(train_iters=6, load=d, metrics_file=metrics))
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    rows = [json.loads(line) for line in open(metrics)]  # every line whole
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    ref = _train(_settings(train_iters=6))
    assert [m["loss"] for m in _read_metrics(metrics).values()] == _losses(ref)


# ---- launch scripts ---------------------------------------------------------------------------
FAKE_SRUN = """#!/usr/bin/env bash
# srun, emulated for one node: record the options, run the command as the node's one task
opts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-on-bad-exit=*) opts+=("$1"); shift ;;
    --nodes|--ntasks-per-node|--cpus-per-task) opts+=("$1" "$2"); shift 2 ;;
    -*) echo "fake srun: unexpected option $1" >&2; exit 9 ;;
    *) break ;;
  esac
done
echo "${opts[*]}" > "$FAKE_SLURM_LOG"
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol, emulated: a long host list (a `| head -n 1` under pipefail would die of SIGPIPE)
case "$1 $2" in
  "show hostnames") echo localhost; seq 1 200000 | sed 's/^/node/' ;;
  "show job") echo "JobId=$3 JobName=megazero"; echo "   Command=$FAKE_SBATCH_SCRIPT"; seq 1 200000 ;;
  *) echo "fake scontrol: $*" >&2; exit 9 ;;
esac
"""


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_slurm_sbatch_runs_end_to_end_under_an_emulated_slurm_and_saves_on_its_signal(tmp_path):
    """launch/slurm.sbatch under fake srun/scontrol on PATH (one node, 2 'GPUs', 2 CPUs): srun gets
    --cpus-per-task, the host list is read without the pipefail trap, and SIGUSR1 to every process of
    the step (as #SBATCH --signal does) makes the ranks save once and the job exit 0."""
    script = os.path.join(ROOT, "launch", "slurm.sbatch")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    d, log = str(tmp_path / "ckpt"), str(tmp_path / "srun.txt")
    env = _env(PATH=f"{fake}:{os.environ['PATH']}", FAKE_SLURM_LOG=log, FAKE_SBATCH_SCRIPT=script,
               SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="localhost,node[1-200000]", SLURM_NNODES="1",
               SLURM_GPUS_ON_NODE="2", SLURM_CPUS_PER_TASK="2", SLURM_SUBMIT_DIR=str(tmp_path),
               MASTER_PORT=str(_free_port()))
    cmd = ["bash", script, *TINY, "--train-iters", "1000", "--save", d]
    with Launch(cmd, env, str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +3/1000", 300)
        for pid in _children(run.proc.pid):  # the step's processes, not the batch shell
            os.kill(pid, signal.SIGUSR1)
        assert run.wait(300) == 0, run.text()[-3000:]
    out = run.text()
    assert "slurm.sbatch: 1 nodes x 2 GPUs, 2 CPUs per node, 1 threads per rank, rendezvous localhost:" in out
    assert open(log).read().split() == ["--kill-on-bad-exit=1", "--nodes", "1", "--ntasks-per-node", "1",
                                        "--cpus-per-task", "2"]
    stop = re.search(r"stopping after iteration (\d+): SIGUSR1 received", out)
    assert stop and out.count("saved checkpoint at iteration") == 1, out[-3000:]
    assert latest_iteration(d) == int(stop.group(1))


@pytest.mark.slow
def test_run_multinode_with_two_agents_on_localhost(tmp_path):
    """launch/run_multinode.sh twice on this host (--nnodes 2, one process each, c10d rendezvous at
    127.0.0.1): they form one job of 2 data-parallel ranks and both exit 0 after saving; the launchers'
    join before torchrun (by --node-rank) passes without a line."""
    script = os.path.join(ROOT, "launch", "run_multinode.sh")
    d, port = str(tmp_path / "ckpt"), str(_free_port())
    runs = []
    try:
        for node in range(2):
            cmd = ["bash", script, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
                   "--nproc-per-node", "1", "--rdzv-id", "two-agents", "--node-rank", str(node), "--run-dir",
                   str(tmp_path / f"run{node}"), "--", *TINY, "--train-iters", "3", "--save", d]
            runs.append(Launch(cmd, _env(), str(tmp_path / f"node{node}.log"), str(tmp_path)))
        for run in runs:
            assert run.wait(300) == 0, run.text()[-3000:]
    finally:
        for run in runs:
            run.__exit__(None, None, None)
    out = "".join(run.text() for run in runs)
    assert "dp 2" in out and "saved checkpoint at iteration 3" in out and "launch.py" not in out, out[-3000:]
    assert latest_iteration(d) == 3


def _repeated_signals():
    """In a child process (run_ranks), never the pytest process: SIGUSR1 three times, then once more
    after the save started."""
    from megazero.resilience import ExitSignals
    signals = ExitSignals(["SIGUSR1"], grace=0.3)
    with signals:
        for _ in range(3):  # the scheduler's, the launcher's forwarded copy, the agent's death
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.02)
        before = (signals.received, signals.repeats)
        signals.saving()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.02)
        return before, signals.repeats


def test_repeated_signals_are_one_request_until_the_grace_period_after_the_save_started():
    [(before, after)] = run_ranks(_repeated_signals, 1)
    assert before == ("SIGUSR1", 2)  # still alive: one request
    assert after == 3  # within the grace period after the save started
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal, time\n"
        "from megazero.resilience.signals import ExitSignals\n"
        "s = ExitSignals(['SIGTERM'], grace=0.2); s.install(); os.kill(os.getpid(), signal.SIGTERM)\n"
        "s.saving(); time.sleep(0.3); os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5); print('alive')\n")],
        env=_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGTERM and "alive" not in child.stdout  # past the grace: at once


@pytest.mark.slow
def test_after_a_termination_signal_the_launcher_restarts_nothing(tmp_path):
    """Without --exit-signal-handler the ranks die of the forwarded SIGTERM; under --max-restarts 2
    the launcher ends the job (one line, 128 + 15) instead of restarting them."""
    cmd = _launch(2, "--train-iters", "100000", extra=("--max-restarts", "2"))
    with Launch(cmd, _env(), str(tmp_path / "out.log"), str(tmp_path)) as run:
        run.wait_for(r"iteration +2/100000", 300)
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.wait(120) == 128 + signal.SIGTERM, run.text()[-3000:]
    out = run.text()
    assert out.rstrip().splitlines()[-1].startswith("launch.py: SIGTERM received: not every rank stopped")
    assert out.count("iteration      1/100000") == 1 and "Traceback" not in out  # no second attempt


def _join(nnodes, ranks, timeout, port):
    """``join_nodes`` of one node per rank in ``ranks`` (threads of this process): (ok, output) each."""
    import io
    import threading
    from megazero.resilience.join import join_nodes
    out = {r: io.StringIO() for r in ranks}
    ok = {}

    def node(r):
        ok[r] = join_nodes("127.0.0.1", port, nnodes, r, timeout, interval=1.0, stream=out[r])
    threads = [threading.Thread(target=node, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 120)
    return [(ok.get(r), out[r].getvalue()) for r in ranks]


def test_a_node_whose_peers_never_join_names_them_and_fails(tmp_path, monkeypatch):
    """The launcher's pre-rendezvous: 3 nodes all joining pass at once and silently; 2 of 3 (a 3 s
    --join-timeout) print waiting lines and then one line naming node 2 and its SLURM host."""
    from megazero.resilience.join import join_port, node_rank_of
    assert _join(3, [2, 0, 1], 120, _free_port()) == [(True, ""), (True, ""), (True, "")]
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho hostA; echo hostB; echo hostC\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "host[A-C]")
    start = time.monotonic()
    results = _join(3, [0, 1], 3, _free_port())
    assert time.monotonic() - start < 60
    for ok, out in results:
        assert not ok, out
        assert "launch.py: waiting for node 2 of 3 at 127.0.0.1:" in out, out
        last = out.rstrip().splitlines()[-1]
        assert re.match(r"launch.py: node 2 of 3 did not join at 127.0.0.1:\d+ within 3 s \(--join-timeout; "
                        r"2 joined\); missing hosts: hostC$", last), out
    ok, out = _join(2, [None], 2, _free_port())[0]  # no node rank: the nodes that joined, by hostname
    assert not ok and re.search(r"1 of 2 nodes did not join .*joined: \S+ \(pid \d+\)\)$", out.strip()), out
    assert join_port(29500) == 30500 and join_port(65000) == 64000
    assert node_rank_of(["--nnodes", "2", "--node-rank", "1"], {}) == 1
    assert node_rank_of([], {"SLURM_NODEID": "3"}) == 3 and node_rank_of([], {}) is None


class _ClosingStore:
    """A join store whose host closes it as soon as this node says it has read the outcome."""

    def __init__(self, values):
        self.values, self.closed = {}, False
        for key, value in values.items():
            self.set(key, value)

    def add(self, key, n):
        if self.closed:
            raise RuntimeError("Connection was likely closed")
        self.values[key] = self.values.get(key, 0) + n
        self.closed = key.endswith("/left") and n > 0
        return self.values[key]

    def set(self, key, value):  # counters stay ints, strings are stored as bytes (as TCPStore returns)
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


@pytest.mark.parametrize("others,want", [
    ({"megazero/join/count": 1}, ""),  # the other node is in: this one completes the join
    ({"megazero/join/failed": "node 2 of 3 did not join (host's line)"}, "node 2 of 3 did not join"),
])
def test_a_node_keeps_the_outcome_when_the_host_closes_the_join_after_it(monkeypatch, others, want):
    """The host's store closes once every joined node has read the outcome: the node's outcome (all
    joined, or the host's line naming the missing nodes) stands, not "the join ended"."""
    import io
    from megazero.resilience import join
    monkeypatch.setattr(join, "_connect", lambda *a: (_ClosingStore(others), False))
    out = io.StringIO()
    assert join.join_nodes("127.0.0.1", 1, 2, None, 30, interval=1.0, stream=out) is (want == "")
    assert (want in out.getvalue()) and "ended before" not in out.getvalue(), out.getvalue()


def test_the_launcher_refuses_a_bad_join_timeout(capsys):
    from models.cli import launch_main
    assert launch_main(["--join-timeout", "soon", "--nnodes", "2", "x.py"]) == 2
    assert "launch.py: error: --join-timeout needs seconds (0 or more), got 'soon'" in capsys.readouterr().err


@pytest.mark.parametrize("flags,line", [
    (["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:999999"],
     "launch.py: error: --rdzv-endpoint localhost:999999: The port number of the rendezvous endpoint "
     "'localhost:999999' must be an integer between 0 and 65536."),
    (["--master-port", "99999"],
     "launch.py: error: --master-port 99999: a port number is between 0 and 65535"),
    (["--nnodes", "1:x"], "launch.py: error: --nnodes 1:x: give a number of nodes, or MIN:MAX"),
    (["--nproc-per-node", "two"],
     "launch.py: error: --nproc-per-node: Unsupported nproc_per_node value: two"),
])
def test_a_bad_launcher_argument_is_one_line_and_status_2(capsys, flags, line):
    """torchrun raises on these deep inside the launch (a 35-line traceback for the endpoint)."""
    from models.cli import launch_main
    assert launch_main(["--nproc-per-node", "2", *flags, "x.py"]) == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_single_host_launch_serves_its_stores_on_loopback_only():
    """torchrun's TCPStore server listens on every interface whatever host it is given; on one host
    the launcher hands it a socket bound to 127.0.0.1 (and tells the workers to connect there);
    launches over several nodes are left alone."""
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from megazero.resilience.loopback import loopback_store_class, single_host
    store = loopback_store_class(dist.TCPStore)("localhost", 0, is_master=True, multi_tenant=True)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v" and isinstance(store, dist.TCPStore)
    assert ("127.0.0.1", store.port) in listening(os.getpid())
    assert not [a for a, p in listening(os.getpid()) if p == store.port and a != "127.0.0.1"]
    one = [["--standalone"], ["--nnodes", "1"],
           ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400"]]
    many = [["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400"],
            ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400"],
            ["--nnodes", "1", "--master-addr", "node0"]]
    assert [single_host(torchrun.parse_args(f + ["x.py"])) for f in one + many] == [True] * 3 + [False] * 3
