"""The optimizer state on NVMe (--offload-optimizer-device nvme) in training: every loss and every final
weight equal to the in-memory run (the same operations on the same numbers, so bitwise), under ZeRO
1/2/3, DP, TP x PP x DP, fp16 with a skipped step; checkpoints written by an NVMe run load into the
in-memory layout and back; bad input is refused by flag name before training starts."""
import os
import re

import pytest
import torch

from megazero.checkpoint import read_weights
from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks

# 16 KiB x 3 keys per streaming buffer: sub-groups of 4096 elements, so the tiny GPT (~57k
# parameters) streams about 14 sub-groups per rank and the read-ahead / write-back really overlap
BUFFER = 3 * 16384


def _cfg(iters=3, nvme=None, params_too=False, **extra):
    settings = dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, global_batch_size=8, micro_batch_size=2, train_iters=iters,
                    lr_decay_iters=4, optimizer="adam", lr=3e-3, clip_grad=0.05, weight_decay=0.1,
                    log_interval=100, hidden_dropout=0.0, attention_dropout=0.0, zero_stage=1)
    if nvme is not None:
        settings.update(offload_optimizer_device="nvme", nvme_path=str(nvme), nvme_buffer_size=BUFFER,
                        nvme_block_size=16384)
        if params_too:
            settings.update(offload_param_device="nvme")
    aliases = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "zero": "zero_stage"}
    settings.update({aliases.get(k, k): v for k, v in extra.items()})
    return config_from_dict(settings)


def _train(cfg, poison_at=None):
    from megazero.training import train
    return train(cfg, _provider(poison_at))


def _provider(poison_at):
    """models.build_chunks, with an inf in one gradient in backward pass number ``poison_at``."""
    import models

    def provider(cfg, mesh):
        chunks = models.build_chunks(cfg, mesh)
        if poison_at is not None:
            calls = {"n": 0}

            def poison(grad):
                calls["n"] += 1
                return grad * float("inf") if calls["n"] == poison_at else grad
            next(chunks[-1].parameters()).register_hook(poison)
        return chunks
    return provider


def _run(cfg, world=1, poison_at=None):
    if world == 1:
        return _train(cfg, poison_at)
    ranks = run_ranks(_train, world, cfg, poison_at, timeout=180)
    for hist in ranks[1:]:
        assert [m["loss"] for m in hist] == [m["loss"] for m in ranks[0]]
    return ranks[0]


def _weights(directory):
    return read_weights(str(directory))[3]


def _same_run(tmp_path, world=1, poison_at=None, params_too=False, **changes):
    """In memory and on NVMe, each saving at the end: the losses and the final weights agree bitwise."""
    swap = tmp_path / "swap"
    swap.mkdir()
    ref = _run(_cfg(save=str(tmp_path / "mem"), **changes), world, poison_at)
    got = _run(_cfg(nvme=swap, save=str(tmp_path / "nvme"), params_too=params_too, **changes), world,
               poison_at)
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]
    assert [repr(m["grad_norm"]) for m in got] == [repr(m["grad_norm"]) for m in ref]  # nan when skipped
    a, b = _weights(tmp_path / "mem"), _weights(tmp_path / "nvme")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert os.listdir(swap) == []  # the swap files are scratch: removed at the clean exit
    assert all(m["io_read_bytes"] > 0 and m["io_write_bytes"] > 0 and m["io_wait_s"] >= 0 for m in got
               if not m["skipped"])
    assert all(m["nvme_bytes"] > 0 and m["optim_bytes"] == 0 for m in got)
    assert len({m["loss"] for m in ref}) > 1  # the model trained: not two untouched models compared
    return ref, got


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_nvme_equals_in_memory_one_process(tmp_path, zero):
    _same_run(tmp_path, zero=zero)


def test_nvme_equals_in_memory_dp2_zero2(tmp_path):
    _same_run(tmp_path, world=2, zero=2)


def test_nvme_equals_in_memory_tp2_pp2_dp2(tmp_path):
    _same_run(tmp_path, world=8, tp=2, pp=2, zero=1, num_layers=4, train_iters=2)


@pytest.mark.parametrize("world,recompute", [(1, False), (2, True)], ids=["one-process", "dp2-recompute"])
def test_zero3_parameters_and_optimizer_on_nvme(tmp_path, world, recompute):
    """--offload-param-device nvme: every unit's shard is read from disk one unit ahead in forward,
    again (reverse order) in backward and for the recomputation replay, and written back after the
    step; the run equals the in-memory ZeRO-3 run bitwise."""
    extra = dict(recompute_granularity="full") if recompute else {}
    ref, got = _same_run(tmp_path, world=world, params_too=True, zero=3, num_layers=4, **extra)
    assert all(m["nvme_param_bytes"] > 0 and m["param_bytes"] == 0 for m in got)
    # the root unit (embeddings, final norm) and two of the 4 layers at most are in memory at once
    assert got[-1]["peak_param_bytes"] < ref[-1]["peak_param_bytes"]


def test_fp16_skipped_step_leaves_the_nvme_state_alone(tmp_path):
    # an inf in a gradient of step 2 (backward 5: four micro-batches a step): that step is skipped
    # on both sides (no I/O, the state on disk unchanged), the scale halves, steps 3 and 4 go through
    ref, got = _same_run(tmp_path, poison_at=5, fp16=True, initial_loss_scale=1024.0, hysteresis=1,
                         train_iters=4)
    assert [m["skipped"] for m in got] == [0, 1, 0, 0]
    assert [m["loss_scale"] for m in got] == [1024.0, 512.0, 512.0, 512.0]
    assert got[1]["io_read_bytes"] == 0 and got[1]["io_write_bytes"] == 0


def test_resume_nvme_to_memory_and_back(tmp_path):
    """NVMe (iterations 1-2) -> in memory (3-4) -> NVMe (5-6), each loading the previous checkpoint,
    equals the uninterrupted in-memory run bitwise: the checkpoint streamed out of and into the swap
    file, one sub-group at a time, holds the same master weights and moments."""
    swap, ck = tmp_path / "swap", str(tmp_path / "ck")
    swap.mkdir()
    common = dict(lr_decay_iters=6)
    ref = _run(_cfg(6, **common))
    first = _run(_cfg(2, nvme=swap, save=ck, **common))
    second = _run(_cfg(4, load=ck, save=ck, **common))
    third = _run(_cfg(6, nvme=swap, load=ck, **common))
    assert [m["iteration"] for m in first + second + third] == list(range(1, 7))
    assert [m["loss"] for m in first + second + third] == [m["loss"] for m in ref]
    assert os.listdir(swap) == []


# ---- bad input: named by flag, before training -------------------------------------------------
def test_nvme_settings_refused_by_flag():
    for changes, needle in (
            (dict(offload_optimizer_device="nvme"), "--nvme-path is required"),
            (dict(offload_param_device="nvme", zero_stage=2),
             "--offload-param-device nvme needs --zero-stage 3"),
            (dict(offload_optimizer_device="nvme", zero_stage=0, nvme_path="/tmp"),
             "--offload-optimizer-device nvme needs --zero-stage 1, 2 or 3"),
            (dict(offload_optimizer=True, offload_optimizer_device="nvme", nvme_path="/tmp"), "contradicts"),
            (dict(optimizer_offload_fraction=1.5, offload_optimizer=True), "--optimizer-offload-fraction"),
            (dict(nvme_block_size=1000), "--nvme-block-size must be a positive multiple of 4096"),
            (dict(nvme_buffer_count=1), "--nvme-buffer-count must be at least 2"),
            (dict(nvme_io_threads=0), "--nvme-io-threads must be at least 1")):
        with pytest.raises(ConfigError, match=needle):
            validate(_cfg(**changes), 1)


def test_missing_path_and_too_little_room_fail_before_training(tmp_path, monkeypatch):
    import shutil
    from megazero.offload import checks
    with pytest.raises(ValueError, match="--nvme-path .*/nope: no such directory"):
        _run(_cfg(nvme=tmp_path / "nope"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--nvme-path .*/file: not a directory"):
        _run(_cfg(nvme=tmp_path / "file"))
    monkeypatch.setattr(checks, "_writable", lambda path: False)  # root writes through any mode bits
    with pytest.raises(ValueError, match="--nvme-path .*: not writable by this process"):
        _run(_cfg(nvme=tmp_path))
    monkeypatch.undo()
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: usage._replace(free=1 << 16))
    # the shortfall is computed up front from the sub-groups: 3 tensors per sub-group, each padded
    # to a 16 KiB block (about 0.7 MiB in all), against 64 KiB free
    with pytest.raises(ValueError, match=r"--nvme-path .*: needs \d+\.\d MiB for this rank's swap files, "
                                         r"0\.1 MiB free"):
        _run(_cfg(nvme=tmp_path, save=str(tmp_path / "never")))
    assert not (tmp_path / "never").exists() or not os.listdir(tmp_path / "never")
    assert [f for f in os.listdir(tmp_path) if f.endswith(".swap")] == []


def test_the_command_line_names_a_missing_path_before_building_the_model(tmp_path, capsys):
    from models.cli.pretrain import main
    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "1", "--zero-stage", "3", "--offload-param-device", "nvme",
             "--nvme-path", str(tmp_path / "nope")]

    def provider(cfg, mesh):
        raise AssertionError("the model was built before --nvme-path was checked")
    assert main(flags, provider) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"pretrain_gpt.py: error: --nvme-path {tmp_path / 'nope'}: no such directory; create it or point "
        "--nvme-path at an existing one"]


def test_a_disk_that_fills_mid_run_stops_it_and_the_last_checkpoint_resumes(tmp_path, monkeypatch):
    """The swap disk fills during iteration 4 (every write from its backward on fails with ENOSPC):
    the run stops with NvmeSpaceError naming --nvme-path, nothing of iteration 4 is saved, the
    tracker still names iteration 2 (confirmed by iteration 3's loss), and resuming from it in
    memory gives the uninterrupted run's losses."""
    import errno
    from megazero.offload import NvmeSpaceError, nvme
    from megazero.offload.checks import io_error
    swap, ck = tmp_path / "swap", str(tmp_path / "ck")
    swap.mkdir()
    ref = _run(_cfg(4))
    full = {"on": False}
    real = nvme.transfer

    def transfer(fd, piece, offset, write, file, before):
        if write and full["on"]:
            raise io_error(OSError(errno.ENOSPC, "No space left on device"), file, "writing")
        return real(fd, piece, offset, write, file, before)
    monkeypatch.setattr(nvme, "transfer", transfer)

    def provider(cfg, mesh):  # four micro-batches a step: backward 13 is iteration 4's first
        chunks = _provider(None)(cfg, mesh)
        calls = {"n": 0}

        def fill(grad):
            calls["n"] += 1
            full["on"] = full["on"] or calls["n"] >= 13
            return grad
        next(chunks[-1].parameters()).register_hook(fill)
        return chunks
    from megazero.training import train
    full_disk = f"--nvme-path {swap}: no space left on device while writing"
    with pytest.raises(NvmeSpaceError, match=full_disk):
        train(_cfg(4, nvme=swap, save=ck, save_interval=2), provider)
    monkeypatch.undo()
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read().strip() == "2"
    rest = _run(_cfg(4, load=ck))
    assert [m["iteration"] for m in rest] == [3, 4]
    assert [m["loss"] for m in rest] == [m["loss"] for m in ref[2:]]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt.py")


def _nvme_flags(swap, iters=100000):
    """A tiny ZeRO-3 run with the parameters and the optimizer state on NVMe (both swap files)."""
    return ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--vocab-size", "100", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--optimizer", "adam", "--lr", "1e-3", "--train-iters", str(iters),
            "--log-interval", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--zero-stage", "3",
            "--offload-optimizer-device", "nvme", "--offload-param-device", "nvme", "--nvme-path", str(swap),
            "--nvme-buffer-size", str(BUFFER), "--nvme-block-size", "16384"]


def _start(log, flags, *extra):
    """pretrain_gpt.py with ``flags``, its output in ``log`` (stdout) and ``log.err``, once it trains."""
    import subprocess
    import sys
    import time
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, SCRIPT, *flags, *extra], env=env, stdout=open(log, "w"),
                            stderr=open(f"{log}.err", "w"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:  # both swap files written by iteration 2
        if re.search(r"^iteration +2/", open(log).read(), re.M):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(open(f"{log}.err").read()[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("harm,file,problem", [
    ("flip", "rank0.swap", r"fails its checksum \(\w{16} read, \w{16} written\)"),
    # cut short again and again while the run writes: a read finds its block past the end, or, when a
    # write has since extended the file over the hole the cut left, zeros where the block was
    ("cut", "params-rank0.swap", r"(lies past the end of the file \(\d+ bytes\): it was cut short|"
                                 r"fails its checksum \(\w{16} read, \w{16} written\))"),
])
def test_a_swap_file_changed_under_a_run_stops_it_in_one_line(tmp_path, harm, file, problem):
    """Bytes flipped in the optimizer's swap file, or the parameters' swap file cut short, while the
    run trains (again and again, until a read finds it): exit status 1 and one line naming the file
    and the block, where the first used to train on to `loss nan` and the second to 87 lines with
    two tracebacks."""
    import subprocess
    import time
    swap = tmp_path / "swap"
    swap.mkdir()
    log = str(tmp_path / "out.log")
    proc = _start(log, _nvme_flags(swap))
    path = str(swap / file)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if not os.path.exists(path):  # the run has stopped (and removed it)
                time.sleep(0.02)
                continue
            size = os.path.getsize(path)
            if harm == "cut":
                os.truncate(path, size // 2)
            else:
                with open(path, "r+b") as fh:
                    for offset in range(9, size, 16384):  # a byte of every block
                        fh.seek(offset)
                        byte = fh.read(1)
                        fh.seek(offset)
                        fh.write(bytes([byte[0] ^ 0xFF]))
            time.sleep(0.02)
        code = proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        raise
    err = open(f"{log}.err").read().splitlines()
    assert code == 1 and len(err) == 1, "\n".join(err[-40:])
    named = (rf"pretrain_gpt.py: error: rank 0: --nvme-path {swap}: swap file {path}, block \d+ of '[\w.]+' "
             rf"\(bytes \d+-\d+\): {problem}; .* resume from the last checkpoint")
    assert re.match(named, err[0]), err[0]


@pytest.mark.slow
def test_a_second_run_on_the_same_nvme_path_is_refused_in_one_line_and_the_first_trains_on(tmp_path, capfd):
    """Run A trains with both tiers on NVMe; run B (2 ranks) is given the same --nvme-path: its rank 0
    finds params-rank0.swap held, its rank 1 gets params-rank1.swap, and every rank refuses alike (exit
    status 2,
    one line from rank 0 naming A's pid and host); A, whose files were not touched, trains on and
    stops cleanly on SIGTERM."""
    import signal
    import socket
    from models.cli import pretrain_main
    swap = tmp_path / "swap"
    swap.mkdir()
    log = str(tmp_path / "first.log")
    first = _start(log, _nvme_flags(swap), "--exit-signal-handler")
    try:
        capfd.readouterr()
        assert run_ranks(pretrain_main, 2, _nvme_flags(swap, iters=2), timeout=300) == [2, 2]
        out = capfd.readouterr()
        lines = [line for line in (out.out + out.err).splitlines() if "error" in line]
        assert len(lines) == 1 and re.fullmatch(
            rf"pretrain_gpt.py: error: --nvme-path {swap}: another run is using the swap file "
            rf"{swap}/params-rank0.swap \(run \w+, pid {first.pid} on {socket.gethostname()}, since "
            rf"[\d: -]+; lock {swap}/.params-rank0.swap.lock\). Two runs must not share a --nvme-path "
            "directory: wait for that run to end, stop it, or give this run its own --nvme-path",
            lines[0]), lines[0]
        assert not (swap / "params-rank1.swap").exists()  # rank 1 closed the store it had opened
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=120)
    finally:
        first.kill()
    assert code == 0 and "stopping after iteration" in open(log).read(), open(f"{log}.err").read()[-3000:]
    assert open(f"{log}.err").read() == ""


def test_megatron_flags_and_the_offload_fraction(tmp_path):
    """--optimizer-cpu-offload / --optimizer-offload-fraction with Megatron-LM's meaning (the share
    offloaded): whole buckets in order while the offloaded elements stay within the fraction; a
    half-offloaded toy (some buckets on NVMe, the rest in memory) equals the in-memory run bitwise."""
    import sys
    from megazero.config import parse_args
    from megazero.offload.settings import optimizer_device
    cfg = parse_args(["--mock-data", "--use-distributed-optimizer", "--optimizer-cpu-offload",
                      "--optimizer-offload-fraction", "0.5"])
    assert optimizer_device(cfg.parallel) == "cpu" and cfg.parallel.optimizer_offload_fraction == 0.5
    sys.path.insert(0, os.path.dirname(__file__))
    from test_zero import _cfg as toy_cfg, _toy_run
    ref = _toy_run(toy_cfg(1, "adam", bucket=4000), h=32)
    for device in ("cpu", "nvme"):
        cfg = toy_cfg(1, "adam", bucket=4000, offload_optimizer_device=device, nvme_path=str(tmp_path),
                      optimizer_offload_fraction=0.5, nvme_buffer_size=3 * 4096)
        got = _toy_run(cfg, h=32)
        assert all(torch.equal(ref["params"][k], got["params"][k]) for k in ref["params"])
    # on NVMe, some of the state left memory, not all of it
    assert 0 < got["memory"]["optim_bytes"] < ref["memory"]["optim_bytes"] and got["memory"]["nvme_bytes"]
