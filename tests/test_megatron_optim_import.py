"""A Megatron-LM run resumes in megazero with its optimizer (issue 45, item 2): Adam's moments and step,
the schedule's settings, the iteration and the consumed samples.

megatron-core trains its GPTModel at TP 2 for three steps (tests/megatron_core_harness.py: its
``FP32Optimizer`` around torch's AdamW, its ``OptimizerParamScheduler``) and saves model and optimizer
as Megatron-LM does: torch_dist (``optimizer.sharded_state_dict``: ``optimizer.state.exp_avg.<name>``
sharded as the weights) and legacy (``optimizer.state_dict()`` in each ``model_optim_rng.pt``).
``pretrain_gpt``'s training resumes from each, at TP 1 and at TP 2 x PP 2, for one step; that step is
checked against a float64 Adam step from the saved state: the new second moment must follow from the
saved one and the gradient the new first moment implies, and the new weight from both with Adam's bias
correction at the saved step + 1.  A resume that drops the moments (``--no-load-optim``) fails it.
"""
import os
import re
import shutil

import numpy as np
import pytest
import torch

from megatron_core_harness import megatron_core  # noqa: F401 - the session fixture
from megazero.config import config_from_dict
from megazero.process.local_ranks import run_ranks

pytestmark = pytest.mark.slow  # megatron-core trains and saves at TP 2 once for the module (about 5 s)
ITERATION, BATCH = 3, 8
CONSUMED = ITERATION * BATCH
LR, BETAS, EPS = 1e-3, (0.9, 0.95), 1e-8


def _megatron_train_and_save(site, root):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=2)
    model = harness.build_gpt()
    opt = harness.megatron_optimizer(model, LR, BETAS, EPS)
    sched = harness.megatron_scheduler(opt, LR)
    harness.train_steps(model, opt, sched, ITERATION, BATCH)
    args = harness.megatron_args(2, CONSUMED)
    for fmt in ("torch_dist", "torch"):
        harness.save_with_optimizer(model, opt, sched, os.path.join(root, fmt), ITERATION, args, fmt)
    return harness.optimizer_moments(model, opt)


@pytest.fixture(scope="module")
def saved(megatron_core, tmp_path_factory):  # noqa: F811
    """``(root, [rank 0's, rank 1's] optimizer states by megatron-core name)``."""
    root = str(tmp_path_factory.mktemp("megatron_optim"))
    states = run_ranks(_megatron_train_and_save, 2, megatron_core, root, timeout=180)
    return root, states


def _cfg(load, save, **extra):
    settings = dict(mock_data=True, load=load, save=save, save_interval=ITERATION + 1,
                    use_checkpoint_args=True,
                    train_iters=ITERATION + 1, micro_batch_size=2, global_batch_size=BATCH, optimizer="adam",
                    lr=LR, lr_decay_style="constant", adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
                    weight_decay=0.0, clip_grad=0.0, log_interval=100)
    settings.update(extra)
    return config_from_dict(settings)


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def _state(directory, key):
    """``{name: whole fp32 tensor}`` of entry ``key`` (master or a moment) of the newest megazero
    checkpoint in ``directory`` (any layout: TP pieces joined, vocabulary padding cut), and its metadata."""
    from megazero.checkpoint.resolve import resolve_here
    from megazero.checkpoint.shards import SavedShards
    path, meta, _ = resolve_here(directory, None)
    src = SavedShards(path, meta)
    out = {}
    try:
        for name, info in meta["params"].items():
            shape = [int(s) for s in info["shape"]]
            pieces = []
            for t in range(src.parts(name)):
                buf = np.empty(int(np.prod(shape)), dtype=np.float32)
                src.read(t, name, key, 0, buf)
                pieces.append(torch.from_numpy(buf).view(shape))
            full = torch.cat(pieces, dim=info["dim"]) if len(pieces) > 1 else pieces[0]
            out[name] = full[:meta["model"]["vocab_size"]] if info["vocab_parallel"] else full
    finally:
        src.close()
    return out, meta


def _adam_mismatch(before, after, step):
    """The largest violation, over every parameter, of one float64 Adam step (weight decay 0) from
    ``before`` (the converted checkpoint: weights, moments, ``step``) to ``after`` (the next save),
    each in units of its bound; <= 1 passes."""
    b1, b2 = BETAS
    worst = 0.0
    t = step + 1
    for name in before[0]:
        w0, m0, v0 = (before[i][name].double() for i in range(3))
        w1, m1, v1 = (after[i][name].double() for i in range(3))
        g = (m1 - b1 * m0) / (1 - b1)  # the gradient the new first moment implies
        v_ref = b2 * v0 + (1 - b2) * g * g
        v_tol = 1e-5 * v_ref.abs().max().item() + 1e-12
        update = LR * (m1 / (1 - b1 ** t)) / ((v1 / (1 - b2 ** t)).sqrt() + EPS)
        w_tol = 1e-6 * max(1.0, w0.abs().max().item()) + 1e-3 * LR
        worst = max(worst, (v1 - v_ref).abs().max().item() / v_tol,
                    (w1 - (w0 - update)).abs().max().item() / w_tol)
    return worst


def _resume(saved, fmt, tmp_path, ranks=1, **extra):
    """One step of megazero from the Megatron checkpoint ``fmt``; ``(before, after, losses, meta)``."""
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    shutil.copytree(os.path.join(saved[0], fmt), src)
    cfg = _cfg(src, out, **extra)
    rows = _train(cfg) if ranks == 1 else run_ranks(_train, ranks, cfg, timeout=240)[0]
    conv = os.path.join(src, "megazero_import")
    meta = _state(conv, "master")[1]
    keys = ("master", "exp_avg", "exp_avg_sq")
    before = None if meta.get("weights_only") else [_state(conv, k)[0] for k in keys]
    after = [_state(out, k)[0] for k in ("master", "exp_avg", "exp_avg_sq")]
    return before, after, rows, meta


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_adam_state_of_megatron_core_is_converted(saved, fmt, tmp_path):
    """The converted moments are megatron-core's (TP 2 pieces joined: qkv rows, proj columns) and the
    step, schedule, iteration and consumed samples are Megatron's."""
    from megazero.checkpoint.megatron import convert
    from megazero.checkpoint.megatron import saved_config
    from megazero.config import validate
    import models
    src = os.path.join(saved[0], fmt)
    whole = validate(config_from_dict(dict(saved_config(src)["model"], mock_data=True)), 1)
    opt = _cfg(src, None).optimizer
    convert(src, str(tmp_path / "conv"), whole, models.build_model, optimizer=opt)
    for key in ("exp_avg", "exp_avg_sq"):
        got, meta = _state(str(tmp_path / "conv"), key)
        ranks = [s for s in saved[1]]
        qkv = torch.cat([r["decoder.layers.1.self_attention.linear_qkv.weight"][key] for r in ranks], 0)
        proj = torch.cat([r["decoder.layers.2.self_attention.linear_proj.weight"][key] for r in ranks], 1)
        norm = ranks[0]["decoder.final_layernorm.weight"][key]
        assert torch.equal(got["decoder.1.attention.qkv.weight"], qkv)
        assert torch.equal(got["decoder.2.attention.proj.weight"], proj)
        assert torch.equal(got["final_norm.weight"], norm)
        assert got["decoder.1.attention.qkv.weight"].abs().max() > 0
    assert meta["optimizer"]["step"] == ITERATION and meta["iteration"] == ITERATION
    assert meta["extra"]["consumed_samples"] == CONSUMED and meta["extra"]["lr_samples"] == CONSUMED
    assert meta["scheduler"] == {"lr": LR, "min_lr": 0.0, "lr_decay_style": "constant"}
    assert not meta.get("weights_only")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_first_resumed_step_is_adam_from_the_saved_moments(saved, fmt, tmp_path):
    before, after, rows, _ = _resume(saved, fmt, tmp_path)
    assert [r["iteration"] for r in rows] == [ITERATION + 1]
    kept = _adam_mismatch(before, after, ITERATION)
    assert kept <= 1.0
    # the same check fails when the moments and step are dropped (a fresh optimizer)
    fresh = _resume(saved, fmt, tmp_path / "fresh", no_load_optim=True)
    assert fresh[0] is None and fresh[3]["weights_only"]  # --no-load-optim: the weights alone
    dropped = _adam_mismatch(before, fresh[1], ITERATION)
    print(f"{fmt}: Adam step from the saved state: worst {kept:.3g} of its bound; fresh optimizer "
          f"{dropped:.3g}")
    assert dropped > 100


def test_tp2_pp2_resumes_with_the_saved_moments_as_tp1(saved, tmp_path):
    """TP 2 x PP 2 (4 ranks; ZeRO shards nothing at DP 1): the same Adam step from the same state, and the
    weights of TP 1's step within fp32 rounding."""
    before, after, rows, _ = _resume(saved, "torch_dist", tmp_path, ranks=4, tensor_model_parallel_size=2,
                                     pipeline_model_parallel_size=2)
    assert _adam_mismatch(before, after, ITERATION) <= 1.0
    one = _resume(saved, "torch_dist", tmp_path / "one")
    for name, w in after[0].items():
        assert (w - one[1][0][name]).abs().max().item() <= 1e-6 * max(1.0, w.abs().max().item()), name


def test_zero2_over_two_data_parallel_ranks_resumes_with_the_saved_moments(saved, tmp_path):
    """DP 2 with ZeRO-2 (the moments on flat buffers split over the ranks)."""
    before, after, _, _ = _resume(saved, "torch", tmp_path, ranks=2, zero_stage=2, micro_batch_size=2)
    assert _adam_mismatch(before, after, ITERATION) <= 1.0


# ---- the distributed optimizer ----------------------------------------------------------------
# (fully_sharded_model_space, megatron-core's default, is written by none: 0.16.1's own save refuses it,
# "ShardedTensor.flattened_range is not supported")
SHARDINGS = ("fully_reshardable", "dp_reshardable")


def _megatron_distributed_save(site, root):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=1)
    model = harness.build_gpt()
    with harness.cuda_tensors_on_cpu():
        opt, sched = harness.trained_with_ddp(model, ITERATION, BATCH // 2, LR, BETAS, EPS)
        args = harness.megatron_args(1, CONSUMED)
        for sharding in SHARDINGS:
            harness.save_distributed_optimizer(model, opt, sched, os.path.join(root, sharding), ITERATION,
                                               args, sharding)
        harness.save_legacy_distributed(model, opt, sched, os.path.join(root, "legacy"), ITERATION, args)


@pytest.fixture(scope="module")
def saved_distributed(megatron_core, tmp_path_factory):  # noqa: F811
    """megatron-core's DistributedOptimizer (DDP over 2 ranks, TP 1) after 3 steps, saved in each of
    ``SHARDINGS`` (torch_dist) and in the legacy format (``legacy``: ``distrib_optim.pt``)."""
    root = str(tmp_path_factory.mktemp("megatron_distopt"))
    run_ranks(_megatron_distributed_save, 2, megatron_core, root, timeout=180)
    return root, None


def test_distributed_optimizer_model_space_state_resumes(saved_distributed, tmp_path):
    """The distributed optimizer saved ``fully_reshardable`` (Megatron-LM's
    ``--dist-ckpt-optim-fully-reshardable``: ``optimizer.state.{exp_avg,exp_avg_sq,param}.<name>`` in
    the model's space, the step in the parameter groups): its first resumed step is Adam's, at TP 1 and
    at DP 2 with ZeRO-1."""
    before, after, rows, meta = _resume(saved_distributed, "fully_reshardable", tmp_path)
    assert meta["optimizer"]["step"] == ITERATION and [r["iteration"] for r in rows] == [ITERATION + 1]
    assert _adam_mismatch(before, after, ITERATION) <= 1.0
    assert before[1]["decoder.0.attention.qkv.weight"].abs().max() > 0
    before, after, _, _ = _resume(saved_distributed, "fully_reshardable", tmp_path / "dp2", ranks=2,
                                  zero_stage=1)
    assert _adam_mismatch(before, after, ITERATION) <= 1.0


def _megatron_bf16_save(site, root):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=1)
    args = harness.megatron_args(1, CONSUMED)
    for distributed, fp16 in ((False, False), (True, False), (False, True)):
        model = harness.build_gpt()
        with harness.cuda_tensors_on_cpu():
            opt, sched = harness.trained_with_ddp(model, ITERATION, BATCH // 2, LR, BETAS, EPS,
                                                  distributed=distributed, bf16=not fp16, fp16=fp16)
            if fp16:
                harness.save_with_optimizer(model, opt, sched, os.path.join(root, "fp16"), ITERATION, args,
                                            "torch_dist")
            elif distributed:
                harness.save_distributed_optimizer(model, opt, sched, os.path.join(root, "distributed"),
                                                   ITERATION, args, "fully_reshardable")
            else:
                for fmt in ("torch_dist", "torch"):
                    harness.save_with_optimizer(model, opt, sched, os.path.join(root, f"float16_{fmt}"),
                                                ITERATION, args, fmt)


@pytest.fixture(scope="module")
def saved_bf16(megatron_core, tmp_path_factory):  # noqa: F811
    """bf16 weights with fp32 main weights in the optimizer (DDP over 2 ranks, TP 1, 3 steps):
    ``float16_torch_dist`` / ``float16_torch`` (``Float16OptimizerWithFloat16Params``:
    ``optimizer.state.fp32_param.<name>``; legacy ``fp32_from_fp16_params``) and ``distributed``
    (``DistributedOptimizer``, fully_reshardable: ``optimizer.state.param.<name>``); and ``fp16``
    (the non-distributed one in fp16, its dynamic loss scale from 2^16)."""
    root = str(tmp_path_factory.mktemp("megatron_bf16"))
    run_ranks(_megatron_bf16_save, 2, megatron_core, root, timeout=180)
    return root, None


@pytest.mark.parametrize("kind", ["float16_torch_dist", "float16_torch", "distributed"])
def test_bf16_run_resumes_from_its_fp32_main_weights(saved_bf16, kind, tmp_path):
    """The fp32 main weights, not the bf16 weights, become megazero's masters (each rounds to its bf16
    weight, and they are not all bf16 values); the first bf16 step is Adam's from the saved state."""
    from megazero.checkpoint.megatron.files import MegatronCheckpoint
    before, after, _, _ = _resume(saved_bf16, kind, tmp_path, bf16=True)
    assert _adam_mismatch(before, after, ITERATION) <= 1.0
    weights = MegatronCheckpoint(os.path.join(saved_bf16[0], kind))
    stored = weights.tensor(*(("decoder.layers.1.self_attention.linear_qkv.weight",) if kind.endswith("torch")
                              else ("decoder.layers.self_attention.linear_qkv.weight", False, 1)))
    master = before[0]["decoder.1.attention.qkv.weight"]
    assert torch.equal(master.bfloat16().float(), stored)
    assert not torch.equal(master, stored)


def test_fp16_run_resumes_with_its_loss_scale(saved_bf16, tmp_path):
    """fp16: the dynamic loss scale continues (2^16 and megatron-core's growth count, not megazero's
    initial 2^32), and the first step is Adam's from the saved state."""
    before, after, rows, meta = _resume(saved_bf16, "fp16", tmp_path, fp16=True)
    assert meta["optimizer"]["scaler"] == {"scale": 2.0 ** 16, "dynamic": True, "growth_tracker": ITERATION,
                                           "hysteresis_tracker": 2}
    assert rows[0]["loss_scale"] == 2.0 ** 16
    assert _adam_mismatch(before, after, ITERATION) <= 1.0


# ---- bad input: one line, exit status 2 ----------------------------------------------------
def _cli(load, capsys, monkeypatch, *extra):
    from models.cli import model_provider
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    code = main(["--mock-data", "--load", load, "--train-iters", str(ITERATION + 1),
                 "--micro-batch-size", "2",
                 "--global-batch-size", str(BATCH), "--lr", str(LR), "--lr-decay-style", "constant",
                 "--adam-beta2", str(BETAS[1]), "--use-checkpoint-args", *extra], model_provider)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def _edit_in_rank(site, path, damage):
    import sys
    sys.path.insert(0, site)
    state = torch.load(path, weights_only=False)
    if damage == "other shape":
        first = state["optimizer"]["state"][1]
        first["exp_avg"] = first["exp_avg"][:-1]
    else:
        state.pop("optimizer")
    torch.save(state, path)


def _edit_rank(site, src, rank, damage):
    """Re-save one legacy rank file damaged (in a child process: its pickled args name megatron-core's
    classes, which this process does not import)."""
    path = os.path.join(src, f"iter_{ITERATION:07d}", rank, "model_optim_rng.pt")
    run_ranks(_edit_in_rank, 1, site, path, damage, timeout=60)


def _drop_from_index(src, damage):
    """Rewrite the torch_dist index (a trusted pickle of the test's own) without one optimizer tensor
    (``missing moment``) or without TP rank 1's chunk of one (``missing chunk``)."""
    import pickle
    path = os.path.join(src, f"iter_{ITERATION:07d}", ".metadata")
    with open(path, "rb") as fh:
        meta = pickle.load(fh)
    if damage == "missing moment":
        name = "optimizer.state.exp_avg_sq.output_layer.weight"
        del meta.state_dict_metadata[name]
        gone = [i for i in meta.storage_data if i.fqn == name]
    else:
        name = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
        gone = [i for i in meta.storage_data if i.fqn == name and i.offset is not None and any(i.offset)]
        chunks = meta.state_dict_metadata[name].chunks
        chunks[:] = [c for c in chunks if not any(c.offsets)]
    assert gone
    for index in gone:
        del meta.storage_data[index]
    with open(path, "wb") as fh:
        pickle.dump(meta, fh)


@pytest.mark.parametrize("damage,needle", [
    ("other shape", r"mp_rank_01/model_optim_rng\.pt: the optimizer's exp_avg of "
                    r"decoder\.layers\.0\.self_attention"
                    r"\.linear_proj\.weight is \(31, 16\), the weight \(32, 16\); pass --no-load-optim"),
    ("missing optimizer", r"mp_rank_01/model_optim_rng\.pt: holds no optimizer state "
                          r"\(the checkpoint's other "
                          r"ranks do\); pass --no-load-optim"),
    ("other betas", r"the Megatron-LM optimizer's betas are \(0\.9, 0\.95\), this run's "
                    r"\(0\.9, 0\.999\); pass "
                    r"--adam-beta1 0\.9 --adam-beta2 0\.95"),
    ("missing moment", r"the Megatron-LM optimizer state holds no exp_avg_sq for megazero's "
                       r"output_layer\.weight; pass --no-load-optim"),
    ("missing chunk", r"the stored chunks of optimizer\.state\.exp_avg\.decoder\.layers\.self_attention\."
                      r"linear_qkv\.weight do not cover it; pass --no-load-optim"),
    ("other schedule", r"the learning-rate schedule differs from the checkpoint's: --lr 0\.001 in the "
                       r"checkpoint, "
                       r"0\.002 in this run"),
])
def test_bad_optimizer_state_is_one_line_and_exit_2(saved, megatron_core,  # noqa: F811
                                                    tmp_path, capsys, monkeypatch, damage, needle):
    src = str(tmp_path / "src")
    if damage in ("missing moment", "missing chunk"):
        shutil.copytree(os.path.join(saved[0], "torch_dist"), src)
        _drop_from_index(src, damage)
    else:
        shutil.copytree(os.path.join(saved[0], "torch"), src)
    extra = []
    if damage in ("other shape", "missing optimizer"):
        _edit_rank(megatron_core, src, "mp_rank_01", damage)
    elif damage == "other betas":
        extra = ["--adam-beta2", "0.999"]
    elif damage == "other schedule":
        extra = ["--lr", "0.002"]
    code, err = _cli(src, capsys, monkeypatch, *extra)
    assert code == 2 and len(err) == 1, err
    assert re.search(needle, err[0]), err[0]
    if damage != "other schedule":  # --no-load-optim: the weights alone, a fresh optimizer
        code, err = _cli(src, capsys, monkeypatch, *extra, "--no-load-optim")
        assert code == 0, err
