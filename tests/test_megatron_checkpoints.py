"""Megatron-LM checkpoints written by megatron-core itself load in megazero (issue 45, item 2).

megatron-core's GPTModel (tests/megatron_core_harness.py: its local layer spec on CPU, gloo) is saved
at TP 2 by its own ``dist_checkpointing.save`` (torch_dist) and as Megatron-LM's legacy per-rank files
(``state_dict()`` of each TP rank).  megazero loads each: its logits equal megatron-core's forward of
the same weights within the fp32 bound; training continues from Megatron's iteration and consumed
samples, at TP 1 and at TP 2 x PP 2 (whose losses equal TP 1's).  Bad input is one line, exit 2.
"""
import os
import shutil

import pytest
import torch

from megatron_core_harness import megatron_core  # noqa: F401 - the session fixture
from megazero.config import config_from_dict
from megazero.process.local_ranks import run_ranks

IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
pytestmark = pytest.mark.slow  # megatron-core saves at TP 2 once for the module (about 15 s)
ITERATION, CONSUMED = 5, 40  # Megatron's trainer state in the checkpoints (8 samples an iteration)


def _megatron_save(site, root):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=2)
    out = {}
    for kind, spec in (("llama", harness.SPEC), ("gpt2", harness.GPT2_SPEC), ("moe", harness.MOE_SPEC)):
        model = harness.build_gpt(spec=spec)
        args = harness.megatron_args(2, CONSUMED, spec)
        harness.save_torch_dist(model, os.path.join(root, kind, "torch_dist"), ITERATION, args, CONSUMED)
        if kind != "moe":  # megazero reads experts from torch_dist only
            harness.save_legacy(model, os.path.join(root, kind, "legacy"), ITERATION, args, CONSUMED)
        out[kind] = harness.forward(model, IDS)
    return out


@pytest.fixture(scope="module")
def saved_models(megatron_core, tmp_path_factory):  # noqa: F811
    """Per model kind, ``(torch_dist dir, legacy dir, megatron-core's logits)``: TP 2 models saved by
    megatron-core (``llama``: GQA, SwiGLU, RMSNorm, RoPE, untied; ``gpt2``: LayerNorm, GELU, biases,
    learned positions, tied; ``moe``: ``llama`` with 4 experts a layer, top-2; torch_dist only)."""
    root = str(tmp_path_factory.mktemp("megatron"))
    logits = run_ranks(_megatron_save, 2, megatron_core, root, timeout=180)
    out = {}
    for kind in ("llama", "gpt2", "moe"):
        assert torch.equal(logits[0][kind], logits[1][kind])
        out[kind] = (os.path.join(root, kind, "torch_dist"), os.path.join(root, kind, "legacy"),
                     logits[0][kind])
    return out


@pytest.fixture(scope="module")
def saved(saved_models):
    return saved_models["llama"]


def _cfg(load, iters=ITERATION + 2, **extra):
    settings = dict(mock_data=True, load=load, use_checkpoint_args=True, train_iters=iters,
                    micro_batch_size=2, global_batch_size=8, optimizer="adam", lr=1e-3,
                    lr_decay_iters=100, log_interval=100)
    settings.update(extra)
    return config_from_dict(settings)


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _bound(ref: torch.Tensor) -> float:
    """fp32 logits after a few layers: a few units of fp32 rounding at the logits' magnitude."""
    return 64 * torch.finfo(torch.float32).eps * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("kind,fmt", [("llama", "torch_dist"), ("llama", "torch"), ("gpt2", "torch_dist"),
                                      ("gpt2", "torch"), ("moe", "torch_dist")])
def test_megatron_checkpoint_loads_with_megatron_core_logits_and_training_continues(
        saved_models, kind, fmt, tmp_path):
    from models.checkpoint import load_model
    saved = saved_models[kind]
    src = str(tmp_path / fmt)
    shutil.copytree(saved[0] if fmt == "torch_dist" else saved[1], src)
    rows = _train(_cfg(src, ckpt_format=fmt))
    assert [r["iteration"] for r in rows] == [ITERATION + 1, ITERATION + 2]  # continues Megatron's count
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    model, info = load_model(os.path.join(src, "megazero_import"))  # the converted copy
    assert info["iteration"] == ITERATION
    with torch.no_grad():
        got = model(IDS)[..., :64]
    ref = saved[2]
    assert (got - ref).abs().max().item() <= _bound(ref)
    mlp = model.decoder["0"].mlp  # the math is checked: a swapped gate/up (a bias shifted) fails it
    with torch.no_grad():
        if kind == "llama":
            mlp.gate.weight.copy_(mlp.fc1.weight)
        elif kind == "moe":
            mlp.experts.gate_weight.copy_(mlp.experts.fc1_weight)
        else:
            mlp.fc1.bias.copy_(mlp.fc1.bias.roll(1))
        assert (model(IDS)[..., :64] - ref).abs().max().item() > 100 * _bound(ref)


def test_consumed_samples_and_schedule_come_from_megatron(saved, tmp_path):
    import json
    src = str(tmp_path / "src")
    shutil.copytree(saved[0], src)
    _train(_cfg(src, iters=ITERATION + 1))
    meta = json.load(open(os.path.join(src, "megazero_import", "iter_0000005", "metadata.json")))
    assert meta["extra"]["consumed_samples"] == CONSUMED and meta["extra"]["lr_samples"] == CONSUMED
    assert meta["iteration"] == ITERATION


def _legacy_pp2(site, src, dst):
    """4 ranks, TP 2 x PP 2: megatron-core's loader reads the TP 2 torch_dist checkpoint into each
    stage, which is saved in the legacy format (mp_rank_TT_PPP, layers numbered per stage)."""
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=2, pp=2)
    model = harness.build_gpt(seed=7, stage=True)
    harness.load_torch_dist(model, os.path.join(src, f"iter_{ITERATION:07d}"))
    args = harness.megatron_args(2, CONSUMED)
    args.pipeline_model_parallel_size = 2
    harness.save_legacy(model, dst, ITERATION, args, CONSUMED)


def test_legacy_checkpoint_of_two_pipeline_stages(saved, megatron_core, tmp_path):  # noqa: F811
    """mp_rank_TT_PPP files of TP 2 x PP 2 (written from megatron-core's stages): the layers of the
    second stage continue the first's numbering; the logits are megatron-core's."""
    from megazero.checkpoint.megatron import convert, saved_config
    from megazero.config import validate
    from models.checkpoint import load_model
    import models
    dst = str(tmp_path / "pp2")
    run_ranks(_legacy_pp2, 4, megatron_core, saved[0], dst, timeout=180)
    assert sorted(os.listdir(os.path.join(dst, f"iter_{ITERATION:07d}"))) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    cfg = validate(config_from_dict(dict(saved_config(dst)["model"], mock_data=True)), 1)
    convert(dst, str(tmp_path / "out"), cfg, models.build_model)
    model, _ = load_model(str(tmp_path / "out"))
    with torch.no_grad():
        got = model(IDS)[..., :64]
    assert (got - saved[2]).abs().max().item() <= _bound(saved[2])


def _train_rank(cfg):
    return _train(cfg)


def test_tp2_pp2_continues_with_the_losses_of_tp1(saved, tmp_path):
    """TP 2 x PP 2 (4 ranks) from the same Megatron checkpoint: the same losses as TP 1 (fp32 sums in
    another order), TP 1's logits being megatron-core's (above)."""
    one, four = str(tmp_path / "one"), str(tmp_path / "four")
    shutil.copytree(saved[0], one)
    shutil.copytree(saved[0], four)
    ref = [r["loss"] for r in _train(_cfg(one))]
    cfg = _cfg(four, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    got = [r["loss"] for r in run_ranks(_train_rank, 4, cfg, timeout=240)[0]]
    assert got == pytest.approx(ref, rel=1e-5)


# ---- bad input: one line, exit status 2 ----------------------------------------------------
def _cli(load, capsys, monkeypatch, *extra):
    from models.cli import model_provider
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    code = main(["--mock-data", "--load", load, "--train-iters", "7", "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-iters", "100", *extra],
                model_provider)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("damage,needle", [
    ("truncated shard", r"__0_0\.distcp is truncated"),
    ("missing shard", r"__1_0\.distcp is missing"),
    ("missing rank", r"mp_rank_01 is missing \(tensor-parallel rank 1"),
    ("truncated rank file",
     r"mp_rank_01/model_optim_rng\.pt: truncated or not a torch file \(PytorchStreamReader"),
    ("pickle payload", r"common\.pt: the file's pickle names posix\.system.*nothing was executed"),
    ("other shape", r"has 4 layers, this model 2; pass --use-checkpoint-args or --num-layers 4"),
    ("other width", r"word_embeddings\.weight is \(64, 32\) in the Megatron-LM checkpoint but "
                    r"\(64, 64\) in this model; pass --use-checkpoint-args"),
    ("wrong format", r"--ckpt-format torch: .* is a torch_dist checkpoint; pass --ckpt-format torch_dist"),
])
def test_bad_megatron_input_is_one_line_and_exit_2(saved, tmp_path, capsys, monkeypatch, damage, needle):
    legacy = damage in ("missing rank", "truncated rank file")
    src = str(tmp_path / "src")
    shutil.copytree(saved[1] if legacy else saved[0], src)
    it = os.path.join(src, f"iter_{ITERATION:07d}")
    marker = tmp_path / "executed"
    extra = ["--use-checkpoint-args"]
    if damage == "truncated shard":
        with open(os.path.join(it, "__0_0.distcp"), "r+b") as fh:
            fh.truncate(100)
    elif damage == "missing shard":
        os.remove(os.path.join(it, "__1_0.distcp"))
    elif damage == "missing rank":
        shutil.rmtree(os.path.join(it, "mp_rank_01"))
    elif damage == "truncated rank file":
        with open(os.path.join(it, "mp_rank_01", "model_optim_rng.pt"), "r+b") as fh:
            fh.truncate(1000)
    elif damage == "pickle payload":
        torch.save({"args": _Payload(marker), "iteration": ITERATION}, os.path.join(it, "common.pt"))
    elif damage == "other shape":
        extra += ["--num-layers", "2"]
    elif damage == "other width":
        extra = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--swiglu",
                 "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                 "--untie-embeddings-and-output-weights", "--seq-length", "16", "--vocab-size", "64"]
    elif damage == "wrong format":
        extra += ["--ckpt-format", "torch"]
    code, err = _cli(src, capsys, monkeypatch, *extra)
    assert code == 2 and len(err) == 1, err
    assert __import__("re").search(needle, err[0]), err[0]
    assert not marker.exists()  # the payload never ran


def test_convert_script_writes_a_checkpoint_megazero_loads(saved, tmp_path, capsys):
    import importlib.util
    from models.checkpoint import load_model
    spec = importlib.util.spec_from_file_location("convert_megatron", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "convert_megatron.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = str(tmp_path / "out")
    assert script.main(["--input", saved[1], "--output", out]) == 0
    model, info = load_model(out)
    with torch.no_grad():
        got = model(IDS)[..., :64]
    assert info["iteration"] == ITERATION and (got - saved[2]).abs().max().item() <= _bound(saved[2])
    assert script.main(["--input", str(tmp_path / "nowhere"), "--output", out]) == 2


# ---- megazero -> Megatron-LM ---------------------------------------------------------------
def _megatron_load(site, directory):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=2)
    from megatron.core import dist_checkpointing
    model = harness.build_gpt(seed=7)  # other weights: every one must come from the file
    path = os.path.join(directory, f"iter_{ITERATION + 2:07d}")
    loaded = dist_checkpointing.load(model.sharded_state_dict(), path)
    missing, _ = model.load_state_dict(loaded, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    common = dist_checkpointing.load_common_state_dict(path)
    return harness.forward(model, IDS), common["iteration"], common["args"].consumed_train_samples


def test_megazero_checkpoint_exported_to_torch_dist_loads_in_megatron_core(
        saved, megatron_core, tmp_path):  # noqa: F811
    """A Megatron run continued by megazero (2 iterations) goes back: megatron-core's own loader reads
    the export at TP 2 and its forward equals megazero's on the same weights."""
    from megazero.checkpoint.megatron.export import export
    from models.checkpoint import load_model
    src, ours, back = str(tmp_path / "src"), str(tmp_path / "ours"), str(tmp_path / "back")
    shutil.copytree(saved[0], src)
    _train(_cfg(src, save=ours))
    export(ours, back)
    model, _ = load_model(ours)
    with torch.no_grad():
        want = model(IDS)[..., :64]
    got, iteration, consumed = run_ranks(_megatron_load, 2, megatron_core, back, timeout=120)[0]
    assert iteration == ITERATION + 2 and consumed == CONSUMED + 16
    assert (got - want).abs().max().item() <= _bound(want)
    assert (got - saved[2]).abs().max().item() > 100 * _bound(want)  # trained on: not the original weights


def test_finetune_from_a_megatron_checkpoint_starts_at_iteration_0(saved, tmp_path):
    """--finetune keeps Megatron-LM's meaning: the weights, then iteration 0 (and the data position,
    schedule and optimizer of a fresh run)."""
    src = str(tmp_path / "src")
    shutil.copytree(saved[0], src)
    rows = _train(_cfg(src, iters=2, finetune=True))
    assert [r["iteration"] for r in rows] == [1, 2]
    again = _train(_cfg(src, iters=ITERATION + 1, no_load_optim=True))  # the iteration continues here
    assert [r["iteration"] for r in again] == [ITERATION + 1]
