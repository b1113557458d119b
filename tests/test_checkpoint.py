"""Checkpoints: resume equals the uninterrupted run, in the same layout and resharded to others;
atomic saves; clear errors."""
import copy
import os

import pytest
import torch

import megazero.checkpoint.writer as ckpt_save
from megazero.checkpoint import CheckpointError, checkpoint_path, latest_iteration, load, save
from megazero.config import ConfigError, config_from_dict, validate
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import RankError, run_ranks
from tolerance import R_TRAIN, R_TRAIN_ADAM

N, K = 4, 2  # iterations in all; the interrupted runs save after K and resume for N - K


def _cfg(iters=N, optimizer="sgd", **extra):
    """A tiny GPT on mock data (4 layers, hidden 32, seq 16); ``extra`` sets any field by name."""
    settings = dict(mock_data=True, num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=100, global_batch_size=8, micro_batch_size=1, train_iters=iters,
                    lr_decay_iters=N, optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 3e-3,
                    log_interval=100, hidden_dropout=0.0, attention_dropout=0.0,  # no dropout: to compare
                    sgd_momentum=0.0)  # plain SGD: no optimizer state but the master weights
    aliases = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "zero": "zero_stage"}
    settings.update({aliases.get(k, k): v for k, v in extra.items()})
    return config_from_dict(settings)


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _run(cfg, world=1):
    if world == 1:
        return _train(cfg)
    ranks = run_ranks(_train, world, cfg, timeout=120)
    for hist in ranks[1:]:
        assert [m["loss"] for m in hist] == [m["loss"] for m in ranks[0]]
    return ranks[0]


def _losses(history):
    return [m["loss"] for m in history]


def _build(cfg):
    """Model chunks and optimizer of one process (for the direct API tests)."""
    import models
    from megazero.zero import build_optimizer
    cfg = validate(copy.deepcopy(cfg), 1)
    mesh = ParallelMesh.single(torch.device("cpu"))
    chunks = models.build_chunks(cfg, mesh)
    return cfg, mesh, chunks, build_optimizer(chunks, mesh, cfg)


# ---- (a) resume in the same layout equals the uninterrupted run -----------------------------
# Resuming in the same layout repeats the same operations on the same numbers (the weights, the
# optimizer state, the RNG and the data position all restored exactly): bit for bit. Resharded
# resumes follow tolerance.py: R_TRAIN / R_TRAIN_ADAM.
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_same_layout_one_process(tmp_path, optimizer):
    from megazero.checkpoint import read_weights
    ref = _run(_cfg(optimizer=optimizer, save=str(tmp_path / "ref")))
    first = _run(_cfg(K, optimizer, save=str(tmp_path / "ck")))
    second = _run(_cfg(N, optimizer, load=str(tmp_path / "ck"), save=str(tmp_path / "ck")))
    assert [m["iteration"] for m in second] == list(range(K + 1, N + 1))
    for key in ("loss", "grad_norm", "lr", "loss_scale"):
        assert [m[key] for m in first + second] == [m[key] for m in ref], key
    assert [m["consumed_samples"] for m in second] == [m["consumed_samples"] for m in ref[K:]]
    want, got = read_weights(str(tmp_path / "ref"))[3], read_weights(str(tmp_path / "ck"))[3]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert len(set(_losses(ref))) == N  # it trained: four different losses


def test_dropout_resume_restores_rng_in_the_same_layout(tmp_path):
    drop = dict(hidden_dropout=0.2, attention_dropout=0.2)
    ref = _run(_cfg(**drop))
    first = _run(_cfg(K, save=str(tmp_path), **drop))
    second = _run(_cfg(load=str(tmp_path), **drop))
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=1e-6)  # the same dropout masks
    cfg, mesh, chunks, opt = _build(_cfg(**drop))
    assert load(str(tmp_path), chunks, opt, mesh, cfg)["rng_restored"]
    cfg, mesh, chunks, opt = _build(_cfg(zero=0, **drop))
    cfg.parallel.num_layers_per_virtual_pipeline_stage = 2  # a different layout: reseeded instead
    state = torch.get_rng_state()
    assert not load(str(tmp_path), chunks, opt, mesh, cfg)["rng_restored"]
    assert not torch.equal(state, torch.get_rng_state())


def test_save_interval_tracker_and_files(tmp_path):
    hist = _run(_cfg(3, save=str(tmp_path), save_interval=2))
    assert len(hist) == 3
    assert latest_iteration(str(tmp_path)) == 3  # every 2 iterations and at the end
    names = sorted(os.listdir(tmp_path))
    assert names == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt",
                     "megazero_config.json"]
    files = sorted(os.listdir(checkpoint_path(str(tmp_path), 3)))
    assert files == ["config.json", "metadata.json", "rng_tp00_pp000_dp000.pt", "shard_tp00_pp000_dp000.bin",
                     "shard_tp00_pp000_dp000.json"]
    # resuming at the last iteration trains nothing and saves nothing new
    assert _run(_cfg(3, load=str(tmp_path), save=str(tmp_path))) == []


def test_fp16_loss_scale_continues(tmp_path):
    fp16 = dict(fp16=True, initial_loss_scale=2.0 ** 20, loss_scale_window=1, num_layers=2, lr_decay_iters=3)
    ref = _run(_cfg(3, "adam", **fp16))
    first = _run(_cfg(1, "adam", save=str(tmp_path), **fp16))
    second = _run(_cfg(3, "adam", load=str(tmp_path), **fp16))
    got = first + second
    assert [m["loss_scale"] for m in got] == [m["loss_scale"] for m in ref]
    assert len({m["loss_scale"] for m in ref}) > 1  # the scale moved: its state was carried over
    assert _losses(got) == pytest.approx(_losses(ref), rel=1e-5)


@pytest.mark.parametrize("saved,resumed,want", [
    (dict(fp16=True), dict(fp16=True, loss_scale=128.0), 128.0),  # constant --loss-scale: saved state ignored
    (dict(fp16=True), dict(bf16=True), 1.0),  # bf16 needs no scaling
    ({}, dict(fp16=True, initial_loss_scale=2.0 ** 10), 2.0 ** 10),  # fp32 -> fp16: --initial-loss-scale
    # dynamic -> dynamic continues
    (dict(fp16=True, initial_loss_scale=2.0 ** 20), dict(fp16=True), 2.0 ** 20),
])
def test_loss_scale_on_resume_follows_this_runs_scaler(tmp_path, saved, resumed, want):
    cfg, mesh, chunks, opt = _build(_cfg(num_layers=2, **saved))
    save(str(tmp_path), 1, chunks, opt, mesh, cfg)
    cfg, mesh, chunks, opt = _build(_cfg(num_layers=2, **resumed))
    load(str(tmp_path), chunks, opt, mesh, cfg)
    assert opt.loss_scale == want


def test_fp16_resumed_with_constant_loss_scale_trains(tmp_path):
    fp16 = dict(fp16=True, num_layers=2, lr_decay_iters=3)
    _run(_cfg(1, "adam", save=str(tmp_path), **fp16))  # dynamic, from 2 ** 32
    second = _run(_cfg(3, "adam", load=str(tmp_path), loss_scale=128.0, **fp16))
    assert [m["loss_scale"] for m in second] == [128.0, 128.0]
    assert [m["skipped"] for m in second] == [0, 0]


# ---- (b) saved under one layout, resumed under others ---------------------------------------
SAVE_LAYOUT = (8, dict(tp=2, pp=2, zero=2))  # TP2 x PP2 x DP2, ZeRO-2

RESUME_LAYOUTS = {  # name: (world, config changes)
    "one-process-zero0": (1, {}),
    "same-layout-tp2-pp2-dp2-zero2": SAVE_LAYOUT,
    "tp1-pp2x2virtual-dp2-zero3": (4, dict(pp=2, zero=3, num_layers_per_virtual_pipeline_stage=1)),
    "tp4-pp2-uneven-zero1": (8, dict(tp=4, pp=2, zero=1, decoder_first_pipeline_num_layers=1)),
}


@pytest.fixture(scope="module")
def saved_tp2_pp2_dp2(tmp_path_factory):
    """The uninterrupted one-process reference and a checkpoint after K steps under SAVE_LAYOUT."""
    directory = str(tmp_path_factory.mktemp("ckpt_tp2_pp2_dp2"))
    world, changes = SAVE_LAYOUT
    first = _run(_cfg(K, save=directory, **changes), world)
    return directory, _run(_cfg()), first


@pytest.mark.parametrize("name", sorted(RESUME_LAYOUTS))
def test_resume_under_another_layout_matches_one_process(saved_tp2_pp2_dp2, name):
    directory, ref, first = saved_tp2_pp2_dp2
    world, changes = RESUME_LAYOUTS[name]
    second = _run(_cfg(load=directory, **changes), world)
    assert [m["iteration"] for m in second] == list(range(K + 1, N + 1))
    # fp32 SGD resumed under another layout: R_TRAIN (was rel 2e-6 (+ abs 1e-6 on the losses);
    # observed 2.6e-8 / 8.6e-8 relative)
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=R_TRAIN)
    assert [m["grad_norm"] for m in second] == pytest.approx([m["grad_norm"] for m in ref[K:]], rel=R_TRAIN)
    assert [m["lr"] for m in second] == [m["lr"] for m in ref[K:]]


def test_saved_files_one_shard_per_rank(saved_tp2_pp2_dp2):
    import json
    path = checkpoint_path(saved_tp2_pp2_dp2[0], K)
    files = sorted(os.listdir(path))
    stems = [f"shard_tp{t:02d}_pp{p:03d}_dp{d:03d}" for t in range(2) for p in range(2) for d in range(2)]
    shards = sorted(s + e for s in stems for e in (".bin", ".json"))
    assert [f for f in files if f.startswith("shard_")] == shards
    assert len([f for f in files if f.startswith("rng_")]) == 8
    meta = json.load(open(os.path.join(path, "metadata.json")))
    assert set(meta["files"]) == set(files) - {"metadata.json"}  # every file recorded with size and CRC
    written = {}
    for d in range(2):  # the two DP ranks of (tp 1, pp 1) each wrote a slice
        index = json.load(open(os.path.join(path, f"shard_tp01_pp001_dp{d:03d}.json")))
        assert index["run_id"] == meta["run_id"] and index["size"] > 0
        for name, key, lo, hi, offset in index["entries"]:
            written.setdefault((name, key), []).append((lo, hi))
    names = {n for n, _ in written}
    assert "output_layer.weight" not in names  # the tied copy is the embedding's
    assert "final_norm.weight" not in names  # replicated over TP: TP rank 0 writes it
    assert {k for n, k in written if n == "decoder.3.attention.qkv.weight"} == {"master"}  # sgd, no momentum
    qkv = meta["params"]["decoder.3.attention.qkv.weight"]
    assert qkv["split"] and qkv["pp"] == 1
    numel = qkv["shape"][0] * qkv["shape"][1]  # the two DP slices cover the TP-local tensor once
    assert sum(hi - lo for lo, hi in written[("decoder.3.attention.qkv.weight", "master")]) == numel


def test_adam_resharded_to_one_process(tmp_path):
    changes = dict(clip_grad=0.05, lr_warmup_iters=1)
    ref = _run(_cfg(optimizer="adam", **changes))
    first = _run(_cfg(K, "adam", save=str(tmp_path), tp=2, pp=2, zero=1, **changes), 8)
    second = _run(_cfg(N, "adam", load=str(tmp_path), **changes))
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=R_TRAIN_ADAM)


def test_zero3_untied_saved_and_resharded_to_tp2(tmp_path):
    untied = dict(untie_embeddings_and_output_weights=True)
    ref = _run(_cfg(**untied))
    first = _run(_cfg(K, save=str(tmp_path), zero=3, **untied), 2)  # DP2 ZeRO-3: parameters sharded
    second = _run(_cfg(load=str(tmp_path), tp=2, **untied), 2)  # the output head re-split over TP
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=R_TRAIN)


# ---- (c) a crash mid-save leaves the previous checkpoint in force ---------------------------
def test_crash_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cfg, mesh, chunks, opt = _build(_cfg())
    d = str(tmp_path)
    save(d, 1, chunks, opt, mesh, cfg)

    def crash(obj, path):  # the data shard is written, then the RNG file fails
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ckpt_save, "_write", crash)
    with pytest.raises(CheckpointError, match="disk full"):
        save(d, 2, chunks, opt, mesh, cfg)
    assert latest_iteration(d) == 1
    assert not os.path.exists(checkpoint_path(d, 2))
    assert not os.path.exists(checkpoint_path(d, 2) + ".tmp")  # a failed save leaves nothing behind
    os.makedirs(checkpoint_path(d, 2) + ".tmp")  # as a crash (kill -9) mid-save would leave it

    monkeypatch.undo()  # a crash while publishing (metadata being written)
    monkeypatch.setattr(ckpt_save, "write_json", lambda *a: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(CheckpointError, match="killed"):
        save(d, 2, chunks, opt, mesh, cfg)
    assert latest_iteration(d) == 1 and not os.path.exists(checkpoint_path(d, 2))
    assert load(d, chunks, opt, mesh, cfg)["iteration"] == 1

    monkeypatch.undo()
    save(d, 2, chunks, opt, mesh, cfg)  # the next save replaces the leftover
    assert latest_iteration(d) == 2 and sorted(os.listdir(d)) == [
        "iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_crash_mid_swap_of_a_resaved_iteration_keeps_a_complete_checkpoint(tmp_path, monkeypatch):
    cfg, mesh, chunks, opt = _build(_cfg())
    d, final = str(tmp_path), checkpoint_path(str(tmp_path), 2)
    save(d, 2, chunks, opt, mesh, cfg, extra={"copy": "first"})
    real = os.rename

    def crash_at_swap(src, dst):  # killed after iter_0000002 -> .old, before .tmp -> iter_0000002
        if src == final + ".tmp" and dst == final:
            raise OSError("killed at the swap (injected)")
        real(src, dst)

    monkeypatch.setattr(os, "rename", crash_at_swap)
    with pytest.raises(CheckpointError, match="killed at the swap"):
        save(d, 2, chunks, opt, mesh, cfg, extra={"copy": "second"})
    monkeypatch.undo()
    assert latest_iteration(d) == 2 and not os.path.exists(final)
    info = load(d, chunks, opt, mesh, cfg)  # the tracker's iteration still loads: the previous copy
    assert info["iteration"] == 2 and info["extra"] == {"copy": "first"}
    save(d, 2, chunks, opt, mesh, cfg, extra={"copy": "third"})  # the next save cleans up
    assert sorted(os.listdir(d)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert load(d, chunks, opt, mesh, cfg)["extra"] == {"copy": "third"}
    save(d, 2, chunks, opt, mesh, cfg, extra={"copy": "fourth"})  # an uninterrupted re-save leaves no .old
    assert sorted(os.listdir(d)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert load(d, chunks, opt, mesh, cfg)["extra"] == {"copy": "fourth"}


def _save_with_failing_rank(directory, bad_rank):
    import models
    from megazero.training import build_mesh
    from megazero.zero import build_optimizer
    cfg = validate(_cfg(zero=1), 2)
    mesh = build_mesh(cfg)
    chunks = models.build_chunks(cfg, mesh)
    opt = build_optimizer(chunks, mesh, cfg)
    save(directory, 1, chunks, opt, mesh, cfg)
    if mesh.rank == bad_rank:
        ckpt_save._write = lambda obj, path: (_ for _ in ()).throw(OSError("injected"))
    try:
        save(directory, 2, chunks, opt, mesh, cfg)
    except CheckpointError as err:
        return str(err)
    return "saved"


def test_one_rank_failing_fails_the_save_everywhere(tmp_path):
    errors = run_ranks(_save_with_failing_rank, 2, str(tmp_path), 1, timeout=60)
    # the cause, everywhere
    assert "rank 1: " in errors[0] and "injected" in errors[0] and "injected" in errors[1]
    assert latest_iteration(str(tmp_path)) == 1 and not os.path.exists(checkpoint_path(str(tmp_path), 2))


# ---- (d) errors -----------------------------------------------------------------------------
def test_a_load_without_a_checkpoint_starts_from_scratch_and_names_it(tmp_path, capsys):
    """As Megatron-LM: a --load directory that is missing or holds no checkpoint (not the --save one
    either) is a warning and a fresh start, the same run as without --load;
    --exit-on-missing-checkpoint makes it an error."""
    from models.cli import pretrain_main
    ref = _losses(_run(_cfg(3)))
    missing, empty = str(tmp_path / "nowhere"), tmp_path / "empty"
    empty.mkdir()
    assert _losses(_run(_cfg(3, load=missing))) == ref
    assert _losses(_run(_cfg(3, load=str(empty)))) == ref
    assert f"WARNING: --load {missing}: no such directory; starting from scratch, as Megatron-LM does " \
        "(--exit-on-missing-checkpoint makes this an error)" in capsys.readouterr().out
    argv = ["--mock-data", "--train-iters", "1", "--load", str(empty), "--save", str(tmp_path / "s")]
    assert pretrain_main(argv) == 0
    said = capsys.readouterr().out
    assert f"WARNING: --load {empty}: it holds no checkpoint; starting from scratch" in said
    assert pretrain_main(argv + ["--exit-on-missing-checkpoint"]) == 2
    assert f"--exit-on-missing-checkpoint: no checkpoint in --load {empty}" in capsys.readouterr().err


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(CheckpointError, match="iter_0000003 is missing or incomplete"):  # asked for by number
        _run(_cfg(load=str(tmp_path), ckpt_step=3))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")
    with pytest.raises(CheckpointError, match="iter_0000007 is missing or incomplete"):
        _run(_cfg(load=str(tmp_path)))


def test_save_and_load_the_same_directory_auto_resumes(tmp_path):
    """Megatron's pattern: the same --save/--load in every job; the first job starts fresh."""
    ref = _run(_cfg())
    d = str(tmp_path / "run")
    first = _run(_cfg(K, save=d, load=d))  # nothing there yet: trains from scratch
    second = _run(_cfg(N, save=d, load=d))  # resumes where the first job stopped
    assert [m["iteration"] for m in second] == list(range(K + 1, N + 1))
    assert _losses(first + second) == pytest.approx(_losses(ref), rel=1e-6)


def _no_model(cfg, mesh):
    raise AssertionError("the model was built: the --save/--load checks did not run first")


def _train_or_error(cfg):
    from megazero.training import train
    try:
        return train(cfg, _no_model)
    except CheckpointError as err:
        return str(err)


def test_unusable_save_dir_fails_before_training(tmp_path):
    from megazero.training import train
    a_file = tmp_path / "a_file"
    a_file.write_text("not a checkpoint directory")
    with pytest.raises(CheckpointError, match="--save /proc/megazero_x: cannot write checkpoints there"):
        train(_cfg(save="/proc/megazero_x"), _no_model)
    with pytest.raises(CheckpointError, match=f"--save {a_file}: exists and is not a directory"):
        train(_cfg(save=str(a_file)), _no_model)
    with pytest.raises(CheckpointError, match=f"--save {a_file}: exists and is not a directory"):
        train(_cfg(save=str(a_file), load=str(a_file)), _no_model)  # was taken for a fresh auto-resume
    with pytest.raises(CheckpointError, match=f"--load {a_file}: exists and is not a directory"):
        train(_cfg(load=str(a_file)), _no_model)
    fresh = tmp_path / "new" / "dir"
    with pytest.raises(AssertionError, match="the model was built"):  # a usable --save passes the probe
        train(_cfg(save=str(fresh)), _no_model)
    assert os.path.isdir(fresh) and os.listdir(fresh) == []  # created; the probe file removed


def test_unusable_save_dir_fails_on_every_rank(tmp_path):
    errors = run_ranks(_train_or_error, 2, _cfg(save="/proc/megazero_x"), timeout=60)
    assert all("--save /proc/megazero_x: cannot write checkpoints there" in e for e in errors)


def _train_with_stale_tracker_on_rank1(cfg):
    """Rank 1's file system shows no tracker yet (attribute caching on a shared file system)."""
    import megazero.checkpoint
    import megazero.checkpoint.reader
    if os.environ["RANK"] == "1":
        megazero.checkpoint.latest_iteration = megazero.checkpoint.reader.latest_iteration = lambda d: None
    return _train(cfg)


def test_rank0_decides_where_to_resume(tmp_path):
    d = str(tmp_path)
    ref = _run(_cfg(zero=1), 2)
    _run(_cfg(K, save=d, load=d, zero=1), 2)
    ranks = run_ranks(_train_with_stale_tracker_on_rank1, 2, _cfg(N, save=d, load=d, zero=1), timeout=60)
    for hist in ranks:  # both resume from K (rank 1 does not start fresh and hang the collectives)
        assert [m["iteration"] for m in hist] == list(range(K + 1, N + 1))
        assert _losses(hist) == pytest.approx(_losses(ref[K:]), rel=1e-6)


@pytest.fixture(scope="module")
def one_process_checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ckpt_one"))
    cfg, mesh, chunks, opt = _build(_cfg())
    save(d, 1, chunks, opt, mesh, cfg)
    return d


@pytest.mark.parametrize("changes,needle", [
    (dict(untie_embeddings_and_output_weights=True), "output head is tied but this run's is untied"),
    (dict(hidden_size=64), r"parameter word_embeddings.weight has shape \(100, 32\) in the checkpoint but "
                           r"\(100, 64\) in this model \(model settings differ: --hidden-size 32"),
    (dict(ffn_hidden_size=64), r"parameter decoder.0.mlp.fc1.weight has shape \(128, 32\) in the checkpoint "
                               r"but \(64, 32\)"),
    (dict(num_layers=2), "the checkpoint's model differs from this run's: --num-layers 4 in the checkpoint"),
    (dict(num_layers=6), "parameter decoder.4"),
    (dict(optimizer="adam"), "optimizer state for --optimizer sgd .none. but this run uses --optimizer adam"),
])
def test_load_mismatch_errors(one_process_checkpoint, changes, needle):
    cfg, mesh, chunks, opt = _build(_cfg(**changes))
    with pytest.raises(CheckpointError, match=needle):
        load(one_process_checkpoint, chunks, opt, mesh, cfg)


@pytest.mark.parametrize("changes,needle", [
    (dict(lr=0.2), "--lr 0.1 in the checkpoint, 0.2 in this run"),
    (dict(min_lr=0.01), "--min-lr 0.0 in the checkpoint, 0.01 in this run"),
    (dict(lr_warmup_iters=1), "--lr-warmup-iters 0 in the checkpoint, 1 in this run"),
    (dict(lr_decay_iters=8), "--lr-decay-iters 4 in the checkpoint, 8 in this run"),
    (dict(lr_decay_iters=None, train_iters=6),
     r"--lr-decay-iters 4 in the checkpoint, 6 in this run \(it defaults"),
    (dict(lr_decay_style="cosine"), "--lr-decay-style linear in the checkpoint, cosine in this run"),
])
def test_lr_schedule_must_match_unless_overridden(one_process_checkpoint, changes, needle):
    cfg, mesh, chunks, opt = _build(_cfg(**changes))
    message = f"learning-rate schedule differs.*{needle}.*--override-opt-param-sch"
    with pytest.raises(CheckpointError, match=message):
        load(one_process_checkpoint, chunks, opt, mesh, cfg)
    cfg, mesh, chunks, opt = _build(_cfg(override_opt_param_scheduler=True, **changes))
    assert load(one_process_checkpoint, chunks, opt, mesh, cfg)["iteration"] == 1
    cfg, mesh, chunks, opt = _build(_cfg(train_iters=10))  # a longer run with the same schedule resumes
    assert load(one_process_checkpoint, chunks, opt, mesh, cfg)["iteration"] == 1


def test_mismatch_under_many_ranks_raises_everywhere(one_process_checkpoint):
    # stage 1 lacks layers 4-5, stage 0 loads but the models differ: both raise, neither hangs
    needle = r"(?s)--num-layers 4 in the checkpoint, 6 in this run.*ranks \[[01]\] failed after it"
    with pytest.raises(RankError, match=needle):
        _run(_cfg(load=one_process_checkpoint, num_layers=6, pp=2), 2)


def test_checkpoint_flags_validated():
    with pytest.raises(ConfigError, match="--ckpt-keep needs --save DIR"):
        validate(_cfg(ckpt_keep=3), 1)
    validate(_cfg(save_interval=3, no_load_optim=True), 1)  # accepted (no effect), as in Megatron-LM


# ---- --finetune, --no-load-optim, --no-load-rng, --use-checkpoint-args, foreign directories ----
@pytest.fixture(scope="module")
def trained_two_steps(tmp_path_factory):
    """Adam, 2 iterations, saved: the directory and the reference history."""
    d = str(tmp_path_factory.mktemp("ckpt_adam"))
    return d, _run(_cfg(K, "adam", save=d))


def test_finetune_starts_at_iteration_zero_with_a_fresh_optimizer(trained_two_steps):
    d, first = trained_two_steps
    tuned = _run(_cfg(3, "adam", load=d, finetune=True, lr=1e-3))  # another schedule is fine: it is fresh
    assert [m["iteration"] for m in tuned] == [1, 2, 3]
    assert [m["consumed_samples"] for m in tuned] == [8, 16, 24]  # the data position starts over
    cfg, mesh, chunks, opt = _build(_cfg(3, "adam", load=d, finetune=True))
    info = load(d, chunks, opt, mesh, cfg)
    assert info["iteration"] == 0 and info["saved_iteration"] == K and not info["optimizer_loaded"]
    assert opt.step_count == 0 and all(float(v.abs().sum()) == 0 for st in opt.state.values()
                                       for k, v in st.items() if k != "step")
    # the weights are the checkpoint's: the first fine-tuning loss is the saved model's loss on samples 0..7
    from megazero.data.mock import MockGPTData
    from models.checkpoint import load_model
    model, _ = load_model(d)
    tokens = MockGPTData(100, 16, seed=1234).get_tokens(list(range(8)), "train")
    with torch.no_grad():
        want = model(tokens[:, :-1], tokens[:, 1:]).mean().item()
    assert tuned[0]["loss"] == pytest.approx(want, rel=1e-6)
    assert tuned[0]["loss"] != pytest.approx(first[0]["loss"], rel=1e-3)  # not the initial weights


def test_no_load_optim_continues_the_iteration_with_fresh_moments(trained_two_steps):
    d, _ = trained_two_steps
    cfg, mesh, chunks, opt = _build(
        _cfg(N, "adam", load=d, no_load_optim=True, lr=0.5))  # schedule not checked
    info = load(d, chunks, opt, mesh, cfg)
    assert info["iteration"] == K and info["extra"]["consumed_samples"] == K * 8 and opt.step_count == 0
    hist = _run(_cfg(N, "adam", load=d, no_load_optim=True))
    assert [m["iteration"] for m in hist] == list(range(K + 1, N + 1))


def test_no_load_rng_reseeds(tmp_path):
    drop = dict(hidden_dropout=0.2)
    _run(_cfg(K, save=str(tmp_path), **drop))
    cfg, mesh, chunks, opt = _build(_cfg(load=str(tmp_path), **drop))
    assert load(str(tmp_path), chunks, opt, mesh, cfg)["rng_restored"]
    cfg, mesh, chunks, opt = _build(_cfg(load=str(tmp_path), no_load_rng=True, **drop))
    assert not load(str(tmp_path), chunks, opt, mesh, cfg)["rng_restored"]


def test_use_checkpoint_args_takes_the_architecture(trained_two_steps, tmp_path):
    from megazero.config import parse_args
    d, _ = trained_two_steps
    cfg = parse_args(["--mock-data", "--load", d, "--use-checkpoint-args", "--finetune"], world_size=1)
    m = cfg.model
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.vocab_size, m.seq_length)
    assert shape == (4, 32, 4, 100, 16)
    cfg = parse_args(["--mock-data", "--load", d, "--use-checkpoint-args", "--seq-length", "8"], world_size=1)
    assert cfg.model.seq_length == 8 and cfg.model.num_layers == 4  # flags given still win
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load DIR"):
        parse_args(["--mock-data", "--use-checkpoint-args"], world_size=1)


def test_load_of_a_foreign_directory_says_what_it_is(trained_two_steps, tmp_path):
    d, _ = trained_two_steps
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_text("")
    with pytest.raises(CheckpointError, match=r"is a Hugging Face model directory; convert it.*convert_hf.py "
                                              r"--direction to-megazero.*--finetune --use-checkpoint-args"):
        _run(_cfg(load=str(hf)))
    with pytest.raises(CheckpointError, match=r"is one iteration of a megazero checkpoint; pass its parent"):
        _run(_cfg(load=checkpoint_path(d, K)))
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000100" / "mp_rank_00").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("100")
    with pytest.raises(CheckpointError, match="mp_rank_00/model_optim_rng.pt is missing"):
        _run(_cfg(load=str(megatron)))
    with pytest.raises(ConfigError, match="--use-checkpoint-args: --load .* Hugging Face model directory"):
        from megazero.config import parse_args
        parse_args(["--mock-data", "--load", str(hf), "--use-checkpoint-args"], world_size=1)


def test_resumed_run_continues_the_metrics_file(tmp_path):
    """Saved at 1, 2, 3; resumed from 1 (--ckpt-step, as if 2 and 3 were lost with the run that died
    after them): the rows of 2 and 3 are dropped and rewritten, each iteration once."""
    import json
    metrics = str(tmp_path / "m.jsonl")
    first = _run(_cfg(3, save=str(tmp_path / "ck"), save_interval=1, metrics_file=metrics))
    hist = _run(_cfg(load=str(tmp_path / "ck"), ckpt_step=1, metrics_file=metrics))
    assert [m["iteration"] for m in hist] == [2, 3, 4]
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows[:3]] == pytest.approx([m["loss"] for m in first], rel=1e-6)


def test_cli_reports_a_checkpoint_error_without_a_traceback(tmp_path, monkeypatch, capsys):
    from models.cli.pretrain import main
    from models.cli import model_provider
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("7\n")  # names a checkpoint not there
    assert main(["--mock-data", "--load", str(tmp_path)], model_provider) == 2
    assert capsys.readouterr().err.startswith(f"pretrain_gpt.py: error: --load {tmp_path}: no usable "
                                              "checkpoint: checkpoint ")


def test_a_save_that_fails_is_a_failure_not_a_usage_error(tmp_path, monkeypatch, capsys):
    """A full disk during a save: exit status 1 (a failure) with one line, where any CheckpointError
    used to give 2, which docs/operations.md reserves for configuration errors and checkpoints that
    cannot be used (the missing --load above); a --save directory refused at start-up stays 2."""
    from megazero.checkpoint import writer
    from models.cli.pretrain import main
    from models.cli import model_provider
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")

    def full_disk(directory, *args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(writer, "write_rank_shard", full_disk)
    flags = ["--mock-data", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
             "--seq-length", "8", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "1", "--save", str(tmp_path / "ck")]
    assert main(flags, model_provider) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "iter_0000001.tmp: no space left on device" in err[0], err
    (tmp_path / "file").write_text("x")
    assert main(flags[:-1] + [str(tmp_path / "file")], model_provider) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
