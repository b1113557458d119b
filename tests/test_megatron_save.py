"""``pretrain_gpt.py --save DIR --ckpt-format torch_dist`` writes Megatron-LM's layout (issue 45, item 3).

A TP 2 x PP 2 run of pretrain_gpt.py (4 forked gloo ranks, dropout 0) saves at iterations 2
(--save-interval) and 4 (the end): ``DIR/iter_*`` in torch_dist (each rank writing its share of the
chunks) with Megatron's args, iteration and consumed samples, and the tracker.  megatron-core's own loader
(tests/megatron_core_harness.py, TP 2) reads the last one into its GPTModel, whose forward equals
megazero's on the saved weights within the fp32 bound.  megazero resumes from iteration 2
(``--load DIR --ckpt-format torch_dist --use-checkpoint-args``) with the losses of the run that went
on; without megazero's own files beside them, the Megatron-LM files give the same logits.
"""
import os
import shutil

import pytest
import torch

from megatron_core_harness import megatron_core  # noqa: F401 - the session fixture
from megazero.config import config_from_dict
from megazero.process.local_ranks import run_ranks

IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=64, make_vocab_size_divisible_by=16, seq_length=16, max_position_embeddings=16,
             activation="swiglu", normalization="RMSNorm", norm_epsilon=1e-5, position_embedding_type="rope",
             rotary_base=10000, add_bias_linear=False, untie_embeddings_and_output_weights=True,
             hidden_dropout=0.0, attention_dropout=0.0)
RUN = dict(mock_data=True, micro_batch_size=2, global_batch_size=8, optimizer="adam", lr=1e-3,
           lr_decay_iters=100, log_interval=100, ckpt_format="torch_dist")


RUN_FLAGS = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--optimizer", "adam",
             "--lr", "1e-3", "--lr-decay-iters", "100", "--log-interval", "100",
             "--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2"]
FLAGS = RUN_FLAGS + [  # MODEL in Megatron-LM's flags
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "48", "--vocab-size", "64",
    "--make-vocab-size-divisible-by", "16", "--seq-length", "16", "--max-position-embeddings", "16",
    "--swiglu",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--position-embedding-type", "rope",
    "--rotary-base", "10000", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--hidden-dropout", "0", "--attention-dropout", "0"]


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


def _rows(path: str):
    import json
    return [json.loads(line) for line in open(path)]


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _bound(ref: torch.Tensor) -> float:
    return 64 * torch.finfo(torch.float32).eps * max(1.0, ref.abs().max().item())


def _logits(directory: str) -> torch.Tensor:
    from models.checkpoint import load_model
    model, _ = load_model(directory)
    with torch.no_grad():
        return model(IDS)[..., :64]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(--save DIR, losses of iterations 1-4)`` of the TP 2 x PP 2 run of pretrain_gpt.py's flags."""
    root = str(tmp_path_factory.mktemp("tdsave"))
    metrics = str(tmp_path_factory.mktemp("tdmetrics") / "m.jsonl")
    argv = FLAGS + ["--train-iters", "4", "--save", root, "--save-interval", "2", "--metrics-file", metrics]
    assert run_ranks(_pretrain, 4, argv, timeout=300) == [0] * 4
    return root, [r["loss"] for r in _rows(metrics)]


@pytest.mark.slow
def test_torch_dist_save_layout(saved):
    from megazero.checkpoint.megatron.safe_load import load_pt
    root, _ = saved
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "4"
    for it in (2, 4):
        path = os.path.join(root, f"iter_{it:07d}")
        files = {".metadata", "common.pt", "metadata.json"} | {f"__{r}_0.distcp" for r in range(4)}
        assert files <= set(os.listdir(path))  # every rank wrote its share
        common = load_pt(os.path.join(path, "common.pt"))
        args = common["args"]
        assert common["iteration"] == it and args.consumed_train_samples == 8 * it
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
        assert common["opt_param_scheduler"]["num_steps"] == 8 * it
    assert sorted(os.listdir(os.path.join(root, "megazero_state"))) >= ["iter_0000002", "iter_0000004"]


@pytest.mark.slow
def test_megatron_core_loads_the_save_with_megazeros_logits(saved, megatron_core):  # noqa: F811
    import megatron_core_harness as harness
    root, _ = saved
    want = _logits(os.path.join(root, "megazero_state"))
    got, iteration, args = run_ranks(harness.load_and_forward, 2, megatron_core,
                                     os.path.join(root, "iter_0000004"), IDS, timeout=180)[0]
    assert iteration == 4 and args["consumed_train_samples"] == 32
    print(f"megatron-core vs megazero logits: {(got - want).abs().max().item():.3g} "
          f"(bound {_bound(want):.3g}, max |logit| {want.abs().max().item():.3g})")
    assert (got - want).abs().max().item() <= _bound(want)
    from models.checkpoint import load_model  # the check can fail: iteration 2's weights differ
    model, _ = load_model(os.path.join(root, "megazero_state"), iteration=2)
    with torch.no_grad():
        early = model(IDS)[..., :64]
    assert (got - early).abs().max().item() > 100 * _bound(want)


@pytest.mark.slow
def test_megazero_resumes_from_its_torch_dist_save_as_if_it_went_on(saved, tmp_path):
    """pretrain_gpt.py --load DIR --ckpt-format torch_dist --use-checkpoint-args (no model flags: the
    model from Megatron-LM's stored args) from iteration 2: the losses of the run that went on."""
    root, losses = saved
    load = str(tmp_path / "load")
    shutil.copytree(root, load)
    metrics = str(tmp_path / "m.jsonl")
    argv = RUN_FLAGS + ["--load", load, "--ckpt-step", "2", "--use-checkpoint-args", "--train-iters", "4",
                        "--metrics-file", metrics]
    assert run_ranks(_pretrain, 4, argv, timeout=300) == [0] * 4
    rows = _rows(metrics)
    assert [r["iteration"] for r in rows] == [3, 4]
    print("losses went on", losses, "resumed", [r["loss"] for r in rows])
    assert [r["loss"] for r in rows] == losses[2:]  # the optimizer state and data position continue


@pytest.mark.slow
def test_the_megatron_files_alone_give_the_same_weights(saved, tmp_path):
    """Without megazero_state (a copy Megatron-LM continues, say), --load converts the torch_dist files."""
    import models
    from megazero.checkpoint.megatron import convert, saved_config
    from megazero.config import validate
    root, _ = saved
    src = str(tmp_path / "src")
    shutil.copytree(root, src, ignore=shutil.ignore_patterns("megazero_state"))
    cfg = validate(config_from_dict(dict(saved_config(src)["model"], mock_data=True)), 1)
    convert(src, str(tmp_path / "out"), cfg, models.build_model)
    want = _logits(os.path.join(root, "megazero_state"))
    diff = (_logits(str(tmp_path / "out")) - want).abs().max().item()
    print(f"converted back: {diff:.3g}")
    assert diff <= _bound(want)


# ---- bad input and other models: fast ------------------------------------------------------
def _cli(capsys, monkeypatch, *extra):
    from models.cli import model_provider
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    try:
        code = main(["--mock-data", "--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size",
                     "2", "--lr", "1e-3", *extra], model_provider)
    except SystemExit as stop:
        code = stop.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_unknown_ckpt_format_is_refused_naming_the_flag(capsys, monkeypatch, tmp_path):
    code, err = _cli(capsys, monkeypatch, "--save", str(tmp_path), "--ckpt-format", "torch_zip")
    assert code == 2 and "--ckpt-format: invalid choice: 'torch_zip'" in err[-1], err
    assert not os.listdir(tmp_path)


def test_models_megatron_gptmodel_cannot_hold_are_named():
    from megazero.checkpoint.megatron.save import not_written
    dense = dict(MODEL, norm_position="pre")
    assert not_written(dense, {}) is None
    assert "--ckpt-format torch_dist: " in not_written(dict(dense, hybrid_layer_pattern="M*-"), {})
    assert "mixture-of-experts" in not_written(dense, {"num_experts": 4})


@pytest.mark.slow
def test_exit_save_async_save_and_ckpt_keep(tmp_path):
    """One process: --async-save every iteration, --ckpt-keep 1 and --exit-interval 3: the exit save is
    the one Megatron-LM copy left (the older ones are pruned with megazero's), and the tracker names it."""
    root = str(tmp_path / "save")
    cfg = config_from_dict(dict(MODEL, **RUN, train_iters=6, save=root, save_interval=1, async_save=True,
                                ckpt_keep=1, exit_interval=3))
    rows = _train(cfg)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert open(os.path.join(root, "latest_checkpointed_iteration.txt")).read() == "3"
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == ["iter_0000003"]
    assert sorted(os.listdir(os.path.join(root, "megazero_state"))) == ["iter_0000003",
                                                                        "latest_checkpointed_iteration.txt"]


@pytest.mark.slow
def test_megazeros_own_checkpoint_of_the_same_iteration_is_never_replaced(tmp_path):
    """A --save directory with megazero-format checkpoints at its top (an earlier run without
    --ckpt-format): a torch_dist save of the same iteration (here a --finetune restarting the count)
    stops with the path named and leaves that checkpoint as it was."""
    from megazero.checkpoint import CheckpointError
    from megazero.checkpoint.resolve import complete_iterations
    root = str(tmp_path / "save")
    base = dict(MODEL, **RUN, train_iters=2, save=root)
    _train(config_from_dict(dict(base, ckpt_format=None)))
    before = open(os.path.join(root, "iter_0000002", "metadata.json")).read()
    with pytest.raises(CheckpointError, match=r"iter_0000002 exists and is not a Megatron-LM torch_dist "):
        _train(config_from_dict(dict(base, load=root, finetune=True)))
    assert open(os.path.join(root, "iter_0000002", "metadata.json")).read() == before
    assert complete_iterations(root) == [2]


@pytest.mark.slow
def test_the_megatron_files_alone_resume_with_adams_state(saved, tmp_path):
    """Without megazero_state, --load converts the torch_dist files, Adam's moments and step included
    (megatron-core's optimizer.state.exp_avg.* names): the losses of the run that went on."""
    root, losses = saved
    load = str(tmp_path / "load")
    shutil.copytree(root, load, ignore=shutil.ignore_patterns("megazero_state"))
    metrics = str(tmp_path / "m.jsonl")
    argv = RUN_FLAGS + ["--load", load, "--ckpt-step", "2", "--use-checkpoint-args", "--train-iters", "4",
                        "--metrics-file", metrics]
    assert run_ranks(_pretrain, 4, argv, timeout=300) == [0] * 4
    rows = _rows(metrics)
    print("converted path: went on", losses, "resumed", [r["loss"] for r in rows])
    assert [r["iteration"] for r in rows] == [3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(losses[2:], rel=1e-6)
    argv[argv.index(metrics)] = metrics = str(tmp_path / "fresh.jsonl")  # the control: a fresh optimizer
    assert run_ranks(_pretrain, 4, argv + ["--no-load-optim"], timeout=300) == [0] * 4
    fresh = _rows(metrics)[-1]["loss"]
    print("--no-load-optim: iteration 4", fresh)
    assert abs(fresh - losses[3]) > 1e-4 * losses[3]


def _megazero_names(name: str):
    """megatron-core's (local spec) parameter -> the megazero parameters it joins."""
    import re
    from megazero.checkpoint.megatron.mapping import GLOBAL, LAYER
    for mine, theirs in GLOBAL.items():
        if name == theirs:
            return [mine]
    i, leaf, kind = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)\.(weight|bias)", name).groups()
    if leaf == "mlp.linear_fc1":
        return [f"decoder.{i}.mlp.gate.{kind}", f"decoder.{i}.mlp.fc1.{kind}"]
    return [f"decoder.{i}.{mine}.{kind}" for mine, theirs in LAYER.items() if theirs[0] == f"{leaf}.{{}}"]


@pytest.mark.slow
def test_megatron_core_optimizer_loads_adams_state(saved, megatron_core):  # noqa: F811
    """megatron-core's FP32Optimizer takes the saved Adam moments and step by its own loader: equal to
    megazero's, tensor for tensor (the stored float32 values)."""
    import megatron_core_harness as harness
    from megazero.checkpoint.megatron.dcp_plan import read_full
    from megazero.checkpoint.resolve import resolve_here
    from megazero.checkpoint.shards import SavedShards
    root, _ = saved
    got = run_ranks(harness.load_optimizer_state, 1, megatron_core, os.path.join(root, "iter_0000004"),
                    timeout=180)[0]
    path, meta, _ = resolve_here(os.path.join(root, "megazero_state"), 4)
    src = SavedShards(path, meta)
    try:
        assert len(got) == len(meta["params"]) - 4  # the gates join linear_fc1
        for name, state in got.items():
            assert int(state["step"]) == 4, name
            for kind in ("exp_avg", "exp_avg_sq"):
                want = torch.cat([read_full(src, n, kind, 64) for n in _megazero_names(name)])
                assert torch.equal(state[kind], want) and want.abs().max() > 0, (name, kind)
    finally:
        src.close()


@pytest.mark.slow
def test_bf16_run_resumes_from_the_megatron_files_alone(tmp_path):
    """bf16 (one process): the fp32 main weights go as megatron-core's mixed-precision optimizer keeps
    them (optimizer.state.fp32_param.*, its common state nested under "optimizer"); --load of the
    Megatron-LM files alone continues with the losses of the run that went on."""
    from megazero.checkpoint.megatron.safe_load import load_pt
    root, load = str(tmp_path / "save"), str(tmp_path / "load")
    base = dict(MODEL, **RUN, bf16=True)
    first = _train(config_from_dict(dict(base, train_iters=4, save=root, save_interval=2)))
    went_on = [r["loss"] for r in first]
    common = load_pt(os.path.join(root, "iter_0000002", "common.pt"))
    assert int(common["optimizer"]["optimizer"]["state"]["common_step"]) == 2
    shutil.copytree(root, load, ignore=shutil.ignore_patterns("megazero_state"))
    rows = _train(config_from_dict(dict(base, train_iters=4, load=load, ckpt_step=2)))
    print("bf16: went on", went_on, "resumed", [r["loss"] for r in rows])
    assert [r["iteration"] for r in rows] == [3, 4]
    assert [r["loss"] for r in rows] == pytest.approx(went_on[2:], rel=1e-6)
