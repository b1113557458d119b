"""Checkpoints on bad days: damaged files are named and skipped for the previous checkpoint, a full
disk leaves nothing behind, a second writer is refused, a NaN model is never saved."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from megazero.checkpoint import (CheckpointCorrupt, CheckpointError, SaveLock, check_save_dir,
                                 checkpoint_path, latest_iteration, load, save)
from megazero.config import config_from_dict, validate
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**extra):
    settings = dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, global_batch_size=4, micro_batch_size=1, train_iters=4, optimizer="adam",
                    lr=1e-3, log_interval=100)
    return config_from_dict(dict(settings, **extra))


def _build(cfg, mesh=None):
    import models
    from megazero.zero import build_optimizer
    mesh = mesh or ParallelMesh.single(torch.device("cpu"))
    cfg = validate(cfg, mesh.world_size)
    chunks = models.build_chunks(cfg, mesh)
    return cfg, mesh, chunks, build_optimizer(chunks, mesh, cfg)


def _two_checkpoints(d):
    """Iterations 1 and 2 in ``d``; their master weights differ (so a fallback is visible)."""
    cfg, mesh, chunks, opt = _build(_cfg())
    save(d, 1, chunks, opt, mesh, cfg, extra={"copy": 1})
    with torch.no_grad():
        for t in opt.update.master.values():
            t.add_(1.0)
    save(d, 2, chunks, opt, mesh, cfg, extra={"copy": 2})
    return cfg, mesh, chunks, opt


def _flip_byte(path, where=0.5):
    data = bytearray(open(path, "rb").read())
    i = int(len(data) * where)
    data[i] ^= 0x5A
    open(path, "wb").write(bytes(data))


FILES = ["metadata.json", "config.json", "shard_tp00_pp000_dp000.bin", "shard_tp00_pp000_dp000.json",
         "rng_tp00_pp000_dp000.pt"]


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_is_named_and_the_previous_checkpoint_loads(tmp_path, name):
    d = str(tmp_path)
    cfg, mesh, chunks, opt = _two_checkpoints(d)
    _flip_byte(os.path.join(checkpoint_path(d, 2), name))
    with pytest.raises(CheckpointCorrupt, match=name.replace(".", r"\.")):
        load(d, chunks, opt, mesh, cfg, iteration=2)  # asked for explicitly: an error naming the file
    info = load(d, chunks, opt, mesh, cfg)  # the newest is corrupt: the previous one, with a warning
    assert info["iteration"] == 1 and info["extra"] == {"copy": 1}
    assert any(name in w for w in info["warnings"]), info["warnings"]


@pytest.mark.parametrize("damage", ["truncate shard", "delete shard", "delete rng", "garble tracker",
                                    "delete metadata"])
def test_incomplete_newest_checkpoint_falls_back(tmp_path, damage):
    d = str(tmp_path)
    cfg, mesh, chunks, opt = _two_checkpoints(d)
    newest = checkpoint_path(d, 2)
    if damage == "truncate shard":
        path = os.path.join(newest, "shard_tp00_pp000_dp000.bin")
        os.truncate(path, os.path.getsize(path) // 2)
    elif damage == "delete shard":
        os.remove(os.path.join(newest, "shard_tp00_pp000_dp000.json"))
    elif damage == "delete rng":
        os.remove(os.path.join(newest, "rng_tp00_pp000_dp000.pt"))
    elif damage == "garble tracker":
        open(os.path.join(d, "latest_checkpointed_iteration.txt"), "w").write("2x\n")
    else:
        os.remove(os.path.join(newest, "metadata.json"))
    info = load(d, chunks, opt, mesh, cfg)
    expected = 2 if damage == "garble tracker" else 1  # a garbled tracker: the newest complete one
    assert info["iteration"] == expected and info["warnings"], info
    assert info["rng_restored"]


def test_nothing_usable_is_one_clear_error(tmp_path):
    d = str(tmp_path)
    cfg, mesh, chunks, opt = _two_checkpoints(d)
    for it in (1, 2):
        os.remove(os.path.join(checkpoint_path(d, it), "shard_tp00_pp000_dp000.bin"))
    with pytest.raises(CheckpointError, match="no usable checkpoint.*shard_tp00_pp000_dp000.bin.*missing"):
        load(d, chunks, opt, mesh, cfg)


def _corrupt_rank1_then_load(d):
    import models
    from megazero.training import build_mesh
    from megazero.zero import build_optimizer
    cfg = validate(_cfg(zero_stage=2), 2)
    mesh = build_mesh(cfg)
    chunks = models.build_chunks(cfg, mesh)
    opt = build_optimizer(chunks, mesh, cfg)
    save(d, 1, chunks, opt, mesh, cfg)
    save(d, 2, chunks, opt, mesh, cfg)
    torch.distributed.barrier()
    if mesh.rank == 0:  # only DP rank 1 reads this file under the same layout
        _flip_byte(os.path.join(checkpoint_path(d, 2), "shard_tp00_pp000_dp001.bin"), 0.9)
    torch.distributed.barrier()
    info = load(d, chunks, opt, mesh, cfg)
    return info["iteration"], info["warnings"]


def test_one_ranks_corrupt_shard_makes_every_rank_fall_back(tmp_path):
    results = run_ranks(_corrupt_rank1_then_load, 2, str(tmp_path), timeout=120)
    for iteration, warnings in results:  # both ranks took the same decision
        assert iteration == 1 and any("shard_tp00_pp000_dp001.bin" in w and "checksum" in w for w in warnings)


def test_a_nonfinite_model_is_never_saved(tmp_path):
    d = str(tmp_path)
    cfg, mesh, chunks, opt = _build(_cfg())
    save(d, 1, chunks, opt, mesh, cfg)
    with torch.no_grad():
        next(iter(opt.update.state.values()))["exp_avg_sq"][3] = float("inf")
    with pytest.raises(CheckpointError, match="refusing to save a non-finite model: exp_avg_sq of parameter"):
        save(d, 2, chunks, opt, mesh, cfg)
    assert latest_iteration(d) == 1
    assert sorted(os.listdir(d)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def _mount_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    return done.returncode == 0


def test_disk_full_on_save_leaves_the_previous_checkpoint_and_nothing_else(tmp_path):
    d = str(tmp_path / "small")
    cfg, mesh, chunks, opt = _build(_cfg())
    one_save = 3 * 4 * opt.num_parameters()  # adam: master + two moments, fp32
    if not _mount_tmpfs(d, one_save + one_save // 2):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        save(d, 1, chunks, opt, mesh, cfg)
        with pytest.raises(CheckpointError, match="no space left on device.*previous one is intact"):
            save(d, 2, chunks, opt, mesh, cfg)
        # no tmp, no probe
        assert sorted(os.listdir(d)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert load(d, chunks, opt, mesh, cfg)["iteration"] == 1
        with pytest.raises(CheckpointError, match="no space left on device"):  # the disk is still full
            save(d, 3, chunks, opt, mesh, cfg)
        shutil.rmtree(checkpoint_path(d, 1))  # free the space: the next save works
        save(d, 3, chunks, opt, mesh, cfg)
        assert latest_iteration(d) == 3
    finally:
        subprocess.run(["umount", "-l", d], capture_output=True)


def test_a_second_writer_is_refused(tmp_path):
    d = str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
         "from megazero.checkpoint.lock import SaveLock; SaveLock.acquire(sys.argv[2]); "
         "print('held', flush=True); time.sleep(120)", ROOT, d], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg, mesh, chunks, opt = _build(_cfg())
        with pytest.raises(CheckpointError, match=r"another run is saving to this directory \(run \w+, pid "
                                                  rf"{holder.pid}"):
            check_save_dir(d, mesh)
        with pytest.raises(CheckpointError, match="another run is saving"):
            save(d, 1, chunks, opt, mesh, cfg)
    finally:
        holder.kill()
        holder.wait()
    lock = check_save_dir(d, mesh)  # the holder died: the lock is free at once
    save(d, 1, chunks, opt, mesh, cfg, lock=lock)
    json.dump({"run_id": "someone-else"}, open(os.path.join(d, ".megazero.lock"), "w"))  # a writer on
    with pytest.raises(CheckpointError, match="another run .* has taken over"):  # a host without flock
        save(d, 2, chunks, opt, mesh, cfg, lock=lock)
    lock.release()
    assert latest_iteration(d) == 1 and not os.path.exists(os.path.join(d, ".megazero.lock"))
    assert isinstance(SaveLock.acquire(d), SaveLock)


def test_save_and_load_time_and_files_are_per_rank(tmp_path):
    """A quick sanity figure: a save writes every rank's slice once and loading reads it back equal."""
    d = str(tmp_path)
    cfg, mesh, chunks, opt = _build(_cfg())
    before = {k: t.clone() for k, t in opt.update.master.items()}
    start = time.perf_counter()
    save(d, 1, chunks, opt, mesh, cfg)
    assert time.perf_counter() - start < 30
    size = os.path.getsize(os.path.join(checkpoint_path(d, 1), "shard_tp00_pp000_dp000.bin"))
    assert size == 3 * 4 * opt.num_parameters()  # master + 2 moments, fp32, nothing else
    with torch.no_grad():
        for t in opt.update.master.values():
            t.zero_()
    load(d, chunks, opt, mesh, cfg)
    assert all(torch.equal(before[k], t) for k, t in opt.update.master.items())


def _retag(d, iteration, fmt):
    """Checkpoint ``iteration`` in ``d`` relabelled as format ``fmt`` (its metadata unsealed, as v1
    wrote it)."""
    path = os.path.join(checkpoint_path(d, iteration), "metadata.json")
    meta = json.load(open(path))
    meta.pop("checksum")
    json.dump(dict(meta, format=fmt), open(path, "w"))


@pytest.mark.parametrize("fmt,needle", [
    ("megazero-checkpoint-v1", r"format 'megazero-checkpoint-v1' is not read by this version of megazero, "
                               r"which reads 'megazero-checkpoint-v2'; megazero at commit 827a2fe"),
    ("someone-elses-v3", r"not a megazero checkpoint \(metadata format 'someone-elses-v3', expected "
                         r"'megazero-checkpoint-v2'\)")])
def test_a_checkpoint_of_another_format_is_refused_by_name(tmp_path, fmt, needle):
    d = str(tmp_path)
    cfg, mesh, chunks, opt = _two_checkpoints(d)
    _retag(d, 2, fmt)  # refused, never skipped for iteration 1: it is no damage
    with pytest.raises(CheckpointError, match=needle) as err:
        load(d, chunks, opt, mesh, cfg)
    assert not isinstance(err.value, CheckpointCorrupt) and "iter_0000002" in str(err.value)


def test_weights_only_checkpoint_is_v2_with_checksums_and_loads_fresh(tmp_path):
    """save_weights (convert_hf's writer) writes the same format as save: sealed metadata, a shard with
    block checksums; read_weights and load verify them; the optimizer starts fresh."""
    from megazero.checkpoint import read_weights, save_weights
    from megazero.checkpoint.format import FORMAT, named_params
    d = str(tmp_path / "w")
    cfg, mesh, chunks, opt = _build(_cfg())
    path = save_weights(d, chunks, mesh, cfg, iteration=0)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert meta["format"] == FORMAT and meta["weights_only"] and "checksum" in meta
    shard = "shard_tp00_pp000_dp000"
    assert sorted(meta["files"]) == ["config.json", shard + ".bin", shard + ".json"]
    _, _, saved_cfg, weights = read_weights(d)
    assert saved_cfg["model"]["hidden_size"] == 32
    for name, p in named_params(chunks):
        if not getattr(p, "tied_copy", False):
            want = p.detach().float()[:100] if getattr(p, "vocab_parallel", False) else p.detach().float()
            assert torch.equal(weights[name], want), name
    cfg2, mesh2, chunks2, opt2 = _build(_cfg(load=d))
    info = load(d, chunks2, opt2, mesh2, cfg2)
    assert not info["optimizer_loaded"] and opt2.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(opt.update.master.values(), opt2.update.master.values()))
    _flip_byte(os.path.join(path, "shard_tp00_pp000_dp000.bin"))
    with pytest.raises(CheckpointCorrupt, match=r"shard_tp00_pp000_dp000\.bin"):
        read_weights(d)


def test_ckpt_step_loads_that_iteration_and_never_falls_back(tmp_path):
    d = str(tmp_path)
    _two_checkpoints(d)
    cfg, mesh, chunks, opt = _build(_cfg(load=d, ckpt_step=1))
    info = load(d, chunks, opt, mesh, cfg, iteration=cfg.checkpoint.ckpt_step)
    assert info["iteration"] == 1 and info["extra"] == {"copy": 1} and not info["warnings"]
    _flip_byte(os.path.join(checkpoint_path(d, 1), "shard_tp00_pp000_dp000.bin"))
    with pytest.raises(CheckpointCorrupt):
        load(d, chunks, opt, mesh, cfg, iteration=1)
