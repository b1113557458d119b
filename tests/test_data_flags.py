"""Megatron-LM's data flags with Megatron-LM's meanings (issue 44 item 2), on tiny .bin/.idx datasets:
data paths from files, separate train/valid/test sets, several validation sets each under its name,
full validation, the .bin read without memory maps, builder threads, the named no-ops, weights of 0
or below, and bad data answered in one line with exit status 2."""
import json
import math

import numpy as np
import pytest
import torch

from megazero.config import ConfigError, parse_args
from megazero.data import build_data
from megazero.data.eval_sets import eval_plan, final_test
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
         "--log-interval", "100", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _dataset(tmp_path, name, lengths, base=0, seed=0):
    """Documents of the given lengths, document k of random ids in [base, base + 40)."""
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / name)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for n in lengths:
            w.add_document(rng.integers(base, base + 40, size=n))
    return prefix


@pytest.fixture()
def sets(tmp_path):
    """Three training-sized sets and two validation sets of 129 tokens each: (129 - 1) / 16 = 8 samples of
    --seq-length 16, two global batches of 4, so --full-validation reads each whole."""
    out = {name: _dataset(tmp_path, name, [50, 60, 70, 40], base=10 * i, seed=i)
           for i, name in enumerate(("a", "b", "c"))}
    out["v1"] = _dataset(tmp_path, "v1", [30, 29, 40, 30], base=60, seed=7)
    out["v2"] = _dataset(tmp_path, "v2", [64, 65], base=80, seed=8)
    out["one"] = _dataset(tmp_path, "one", [129], base=60, seed=9)  # one document: any shuffle, one stream
    out["dir"] = tmp_path
    return out


def _cfg(*flags, eval_interval=0):
    return parse_args(MODEL + ["--train-iters", "2", "--eval-interval", str(eval_interval),
                               "--eval-iters", "1", *flags], world_size=1)


def _tokens(cfg, split="train", n=8):
    return build_data(cfg).get_tokens(range(n), split)


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


# ---- data paths from files ------------------------------------------------------------------------
def test_data_args_path_is_data_path_from_a_file(sets):
    args = sets["dir"] / "blend.txt"
    args.write_text(f"0.7 {sets['a']}\n  0.3\t{sets['b']}\n")
    cfg = _cfg("--data-args-path", str(args))
    assert cfg.data.data_path == ["0.7", sets["a"], "0.3", sets["b"]]
    direct = _cfg("--data-path", "0.7", sets["a"], "0.3", sets["b"])
    assert torch.equal(_tokens(cfg), _tokens(direct))
    with pytest.raises(ConfigError, match="^--data-args-path and --data-path both name the data; give one$"):
        _cfg("--data-args-path", str(args), "--data-path", sets["a"])
    (sets["dir"] / "empty.txt").write_text(" \n")
    with pytest.raises(ConfigError, match="names no dataset prefix"):
        _cfg("--data-args-path", str(sets["dir"] / "empty.txt"))
    with pytest.raises(ConfigError, match=r"^--data-args-path .*nope.txt: cannot read it \(No such file"):
        _cfg("--data-args-path", str(sets["dir"] / "nope.txt"))


def test_per_split_data_args_path_is_the_three_paths_from_json(sets):
    path = sets["dir"] / "splits.json"
    path.write_text(json.dumps({"train": ["2", sets["a"], "1", sets["b"]],
                                "valid": f"{sets['v1']} {sets['v2']}", "test": [sets["c"]]}))
    cfg = _cfg("--per-split-data-args-path", str(path), eval_interval=1)
    assert cfg.data.train_data_path == ["2", sets["a"], "1", sets["b"]]
    assert cfg.data.valid_data_path == [sets["v1"], sets["v2"]] and cfg.data.test_data_path == [sets["c"]]
    direct = _cfg("--train-data-path", "2", sets["a"], "1", sets["b"], "--valid-data-path", sets["v1"],
                  sets["v2"], "--test-data-path", sets["c"], eval_interval=1)
    for split in ("train", "valid", "test"):
        assert torch.equal(_tokens(cfg, split), _tokens(direct, split)), split
    with pytest.raises(ConfigError, match="^--per-split-data-args-path and --train-data-path both name"):
        _cfg("--per-split-data-args-path", str(path), "--train-data-path", sets["a"])
    for bad in ("[1, 2]", '{"valid": ["x"]}', '{"train": ["x"], "dev": ["y"]}', "{not json"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="^--per-split-data-args-path "):
            _cfg("--per-split-data-args-path", str(path))


# ---- weights ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path", "--valid-data-path",
                                  "--test-data-path"])
@pytest.mark.parametrize("weight", ["0", "-0.5", "nan"])
def test_weights_of_zero_or_below_are_refused_in_one_line(sets, flag, weight, monkeypatch, capsys):
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    items = [weight, sets["a"], "1", sets["b"]]
    argv = {"--data-path": ["--data-path", *items],
            "--train-data-path": ["--train-data-path", *items],
            "--valid-data-path": ["--train-data-path", sets["c"], "--valid-data-path", *items],
            "--test-data-path": ["--train-data-path", sets["c"], "--test-data-path", *items]}[flag]
    assert main(MODEL + ["--train-iters", "1"] + argv, lambda cfg, mesh: None) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"pretrain_gpt.py: error: {flag}: the weight '{weight}' before")


def test_a_zero_weight_in_a_data_args_file_is_refused_too(sets):
    args = sets["dir"] / "blend.txt"
    args.write_text(f"1 {sets['a']} 0 {sets['b']}")
    with pytest.raises(ConfigError, match="^--data-path: the weight '0' before"):
        _cfg("--data-args-path", str(args))


# ---- validation and test sets ------------------------------------------------------------------------
def test_each_validation_set_is_reported_under_its_name(sets):
    common = ["--train-data-path", sets["a"], "--eval-iters", "2"]
    cfg = _cfg(*common, "--valid-data-path", sets["v1"], sets["v2"], "--multiple-validation-sets",
               "--validation-set-names", "wiki", "code", eval_interval=1)
    assert eval_plan(build_data(cfg), cfg) == [("-wiki", "valid-wiki", 2), ("-code", "valid-code", 2)]
    history = _train(cfg)
    alone = {name: _train(_cfg(*common, "--valid-data-path", sets[v], eval_interval=1))
             for name, v in (("wiki", "v1"), ("code", "v2"))}
    for it, row in enumerate(history):
        assert "eval_loss" not in row and math.isfinite(row["eval_loss-wiki"])
        for name in ("wiki", "code"):  # the same model and batches as a run with that set alone
            assert row[f"eval_loss-{name}"] == alone[name][it]["eval_loss"], (it, name)
            assert row[f"eval_ppl-{name}"] == pytest.approx(math.exp(row[f"eval_loss-{name}"]))
        assert row["eval_loss-wiki"] != row["eval_loss-code"]
    named = _cfg(*common, "--valid-data-path", sets["v1"], sets["v2"], "--multiple-validation-sets",
                 eval_interval=1)
    assert [s for s, _, _ in eval_plan(build_data(named), named)] == ["-0", "-1"]  # Megatron-LM's indices


def test_full_validation_reads_every_whole_batch_and_the_test_set_comes_last(sets):
    common = ["--train-data-path", sets["a"], "--valid-data-path", sets["one"]]
    full = _cfg(*common, "--full-validation", "--test-data-path", sets["one"], eval_interval=2)
    data = build_data(full)
    ds = IndexedDataset(sets["one"])
    whole = (int(ds.sequence_lengths.sum()) - 1) // 16 // 4  # samples of the epoch / global batch
    assert whole == 2 and eval_plan(data, full) == [("", "valid", whole)]
    assert final_test(data, full) == ("test", 2)
    history = _train(full)
    same = _train(_cfg(*common, "--eval-iters", str(whole), eval_interval=2))
    assert history[-1]["eval_loss"] == same[-1]["eval_loss"]
    assert "test_loss" not in history[0] and "test_loss" not in same[-1]
    # the test set is the validation set's file of one document: read whole, the same 8 samples (in
    # another order), so the same mean loss up to the order of a sum of 8 per-sample fp32 means
    assert history[-1]["test_loss"] == pytest.approx(history[-1]["eval_loss"], rel=1e-6)
    assert history[-1]["test_ppl"] == pytest.approx(math.exp(history[-1]["test_loss"]))


@pytest.mark.parametrize("flags,needle", [
    (["--valid-data-path", "V1", "V2", "--validation-set-names", "x", "y"],
     "--validation-set-names needs --multiple-validation-sets"),
    (["--valid-data-path", "V1", "V2", "--multiple-validation-sets", "--validation-set-names", "x"],
     "--validation-set-names gives 1 names for 2 --valid-data-path sets"),
    (["--valid-data-path", "1", "V1", "1", "V2", "--multiple-validation-sets"],
     "give the prefixes without weights"),
    (["--multiple-validation-sets"], "--multiple-validation-sets needs --valid-data-path"),
    (["--valid-data-path", "V1", "V2", "--full-validation"],
     "--full-validation with a blended validation set"),
    (["--valid-data-path", "V1", "--num-dataset-builder-threads", "0"],
     "--num-dataset-builder-threads must be a positive integer, got 0"),
])
def test_set_flags_that_mean_nothing_are_refused(sets, flags, needle):
    flags = [sets["v1"] if f == "V1" else sets["v2"] if f == "V2" else f for f in flags]
    with pytest.raises(ConfigError, match=needle):
        _cfg("--train-data-path", sets["a"], *flags)


def test_test_data_path_goes_with_train_data_path(sets):
    with pytest.raises(ConfigError, match="--test-data-path goes with --train-data-path"):
        _cfg("--data-path", sets["a"], "--test-data-path", sets["b"])
    with pytest.raises(ConfigError, match="--full-validation reads a validation set to its end"):
        parse_args(MODEL + ["--mock-data", "--full-validation", "--eval-interval", "1"], world_size=1)


# ---- how the files are read ------------------------------------------------------------------------
def test_bin_files_without_memory_maps_and_builder_threads_give_the_same_samples(sets):
    from megazero.data.file_tokens import FileTokens
    blend = ["--data-path", "0.5", sets["a"], "0.3", sets["b"], "0.2", sets["c"], "--split", "80,20,0"]
    ref = _cfg(*blend)
    plain = _cfg(*blend, "--no-mmap-bin-files", "--num-dataset-builder-threads", "3")
    assert ref.data.mmap_bin_files and not plain.data.mmap_bin_files
    data = build_data(plain)
    assert all(isinstance(ds.indexed.tokens, FileTokens) for ds in data.datasets)
    assert not any(isinstance(ds.indexed.tokens, FileTokens) for ds in build_data(ref).datasets)
    for split in ("train", "valid"):
        assert torch.equal(_tokens(plain, split, 24), _tokens(ref, split, 24)), split
    ds, mm = IndexedDataset(sets["a"], mmap=False), IndexedDataset(sets["a"])
    assert ds.max_token_id() == mm.max_token_id() and np.array_equal(ds.document(2), mm.document(2))
    assert _cfg(*blend, "--mmap-bin-files").data.mmap_bin_files


def test_named_no_ops(sets):
    cfg = _cfg("--data-path", sets["a"], "--data-cache-path", "/tmp/cache",
               "--no-create-attention-mask-in-dataloader")
    notes = " ".join(cfg.notes)
    assert "--data-cache-path /tmp/cache: no effect" in notes
    assert "--no-create-attention-mask-in-dataloader: no effect" in notes
    assert cfg.data.data_cache_path == "/tmp/cache" and not cfg.data.create_attention_mask_in_dataloader
    assert torch.equal(_tokens(cfg), _tokens(_cfg("--data-path", sets["a"])))
    assert _cfg("--data-path", sets["a"],
                "--create-attention-mask-in-dataloader").data.create_attention_mask_in_dataloader


# ---- bad data: one line, exit 2 ---------------------------------------------------------------------
def test_bad_data_gets_one_line_and_exit_2(sets, monkeypatch, capsys):
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = _dataset(sets["dir"], "tiny", [5, 6])  # 11 tokens: not one sample of 16 + 1
    cases = [
        (["--train-data-path", sets["a"], "--valid-data-path", tiny, "--eval-interval", "1"],
         f"--valid-data-path {tiny}: the valid set holds 11 tokens (2 documents), fewer than one sample"),
        (["--data-path", sets["a"], "--split", "99,1,0", "--eval-interval", "1"],
         f"--data-path {sets['a']}: the valid split (documents 4..3 of 4, --split 99,1,0) holds 0 tokens"),
        (["--train-data-path", sets["c"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "30"],
         f"--train-data-path {sets['c']}: token id 59 is outside --vocab-size 31"),
    ]
    for flags, needle in cases:
        model = [a for a in MODEL]
        if "--tokenizer-type" in flags:
            i = model.index("--vocab-size")
            del model[i:i + 2]
        assert main(model + ["--train-iters", "1"] + flags, lambda cfg, mesh: None) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (err, needle)


def test_set_flags_with_sft_are_refused_by_name(sets):
    with pytest.raises(ConfigError, match="^--multiple-validation-sets with --sft is not implemented"):
        _cfg("--sft", "--train-data-path", sets["a"], "--valid-data-path", sets["v1"], sets["v2"],
             "--multiple-validation-sets", "--tokenizer-type", "NullTokenizer")


def _train_dp(flags):
    return _train(parse_args(MODEL + flags, world_size=2))


def test_validation_and_test_sets_under_data_parallelism_match_one_process(sets):
    """DP 2 (each rank half of every global batch) reports the one-process losses of every set."""
    from megazero.process.local_ranks import run_ranks
    from tolerance import R_TRAIN_ADAM
    flags = ["--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--train-data-path",
             sets["a"], "--valid-data-path", sets["v1"], sets["v2"], "--multiple-validation-sets",
             "--test-data-path", sets["c"]]
    ref = _train(parse_args(MODEL + flags, world_size=1))
    keys = ("loss", "eval_loss-0", "eval_loss-1")
    for history in run_ranks(_train_dp, 2, flags):
        for got, want in zip(history, ref):  # fp32 Adam, DP 2 vs one process (tolerance.py)
            assert [got[k] for k in keys] == pytest.approx([want[k] for k in keys], rel=R_TRAIN_ADAM)
        assert history[-1]["test_loss"] == pytest.approx(ref[-1]["test_loss"], rel=R_TRAIN_ADAM)
