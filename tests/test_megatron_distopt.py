"""Megatron-LM's DistributedOptimizer state in its bucket-space formats resumes in megazero (issue 45,
item 2): torch_dist ``dp_reshardable`` (Megatron-LM's default with --use-distributed-optimizer) and
the legacy format's ``distrib_optim.pt`` (megazero/checkpoint/megatron/optim_distrib.py).

megatron-core's DDP and DistributedOptimizer (tests/megatron_core_harness.py) train its GPTModel over
two data-parallel ranks (fp32 and bf16) and at TP 2 for three steps and save in both formats, and in
``fully_reshardable`` (the model-space format, read before).  Checked: the converted moments and fp32
main weights equal what megatron-core's optimizer object holds for each parameter (its own range map
and state accessors on each rank, joined), every converted tensor equals the ``fully_reshardable``
conversion (at TP 2: the legacy one), and the first resumed step (TP 1, and DP 2 with ZeRO-1) is a
float64 Adam step from the saved state.  A buffer whose layout cannot be reconstructed is refused in one line.
"""
import os
import shutil

import pytest
import torch

from megatron_core_harness import megatron_core  # noqa: F401 - the session fixture
from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.optim_distrib import _Units, place
from megazero.process.local_ranks import run_ranks

ITERATION, BATCH, LR, BETAS, EPS = 3, 8, 1e-3, (0.9, 0.95), 1e-8
FORMATS = ("dp_reshardable", "legacy")
# megatron-core's parameter -> megazero's (whole tensors; TP 1 so no joining)
NAMES = {"decoder.layers.1.self_attention.linear_qkv.weight": "decoder.1.attention.qkv.weight",
         "decoder.layers.2.self_attention.linear_proj.weight": "decoder.2.attention.proj.weight",
         "decoder.layers.3.mlp.linear_fc2.weight": "decoder.3.mlp.fc2.weight",
         "decoder.final_layernorm.weight": "final_norm.weight"}


def _save(site, root):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=1)
    model = harness.build_gpt()
    with harness.cuda_tensors_on_cpu():
        opt, sched = harness.trained_with_ddp(model, ITERATION, BATCH // 2, LR, BETAS, EPS)
        args = harness.megatron_args(1, ITERATION * BATCH)
        for sharding in ("dp_reshardable", "fully_reshardable"):
            harness.save_distributed_optimizer(model, opt, sched, os.path.join(root, sharding), ITERATION,
                                               args, sharding)
        harness.save_legacy_distributed(model, opt, sched, os.path.join(root, "legacy"), ITERATION, args)
        shards = harness.distributed_optimizer_shards(model, opt)
        bf16 = harness.build_gpt()  # bf16 weights, fp32 main weights in the optimizer
        opt, sched = harness.trained_with_ddp(bf16, ITERATION, BATCH // 2, LR, BETAS, EPS, bf16=True)
        harness.save_distributed_optimizer(bf16, opt, sched, os.path.join(root, "bf16_dp_reshardable"),
                                           ITERATION, args, "dp_reshardable")
        harness.save_legacy_distributed(bf16, opt, sched, os.path.join(root, "bf16_legacy"), ITERATION, args)
    return shards, {n: tuple(p.shape) for n, p in model.named_parameters()}


def _save_tp2(site, root):
    import megatron_core_harness as harness
    harness.setup_rank(site, tp=2)
    model = harness.build_gpt()
    with harness.cuda_tensors_on_cpu():
        opt, sched = harness.trained_with_ddp(model, ITERATION, BATCH, LR, BETAS, EPS)
        args = harness.megatron_args(2, ITERATION * BATCH)
        harness.save_distributed_optimizer(model, opt, sched, os.path.join(root, "dp_reshardable"), ITERATION,
                                           args, "dp_reshardable")
        harness.save_legacy_distributed(model, opt, sched, os.path.join(root, "legacy"), ITERATION, args)
        return harness.distributed_optimizer_shards(model, opt)


@pytest.fixture(scope="module")
def saved(megatron_core, tmp_path_factory):  # noqa: F811
    """``(root, {name: {kind: whole tensor}})``: megatron-core's per-parameter state, each rank's owned
    range put in place."""
    root = str(tmp_path_factory.mktemp("megatron_distopt"))
    ranks = run_ranks(_save, 2, megatron_core, root, timeout=240)
    shapes = ranks[0][1]
    whole = {n: {k: torch.full((int(torch.Size(s).numel()),), float("nan")) for k in
                 ("param", "exp_avg", "exp_avg_sq")} for n, s in shapes.items()}
    for shards, _ in ranks:
        for name, kinds in shards.items():
            for kind, (lo, hi, values) in kinds.items():
                whole[name][kind][lo:hi] = values
    for name, kinds in whole.items():
        for kind in kinds:
            assert not kinds[kind].isnan().any(), (name, kind)  # every element owned by one rank
            kinds[kind] = kinds[kind].view(shapes[name])
    return root, whole


@pytest.fixture(scope="module")
def saved_tp2(megatron_core, tmp_path_factory):  # noqa: F811
    """The DistributedOptimizer at TP 2 (DP 1): ``(root, [rank 0's, rank 1's] per-parameter state)``."""
    root = str(tmp_path_factory.mktemp("megatron_distopt_tp2"))
    return root, run_ranks(_save_tp2, 2, megatron_core, root, timeout=240)


def _convert(root, fmt, dst):
    from test_megatron_optim_import import _cfg, _state
    from megazero.checkpoint.megatron import convert, saved_config
    from megazero.config import config_from_dict, validate
    import models
    src = os.path.join(root, fmt)
    whole = validate(config_from_dict(dict(saved_config(src)["model"], mock_data=True)), 1)
    convert(src, dst, whole, models.build_model, optimizer=_cfg(src, None).optimizer)
    return {key: _state(dst, key) for key in ("master", "exp_avg", "exp_avg_sq")}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_converted_state_is_megatron_cores(saved, fmt, tmp_path):
    """The moments and fp32 main weights equal megatron-core's optimizer's, parameter by parameter, and
    every converted tensor equals the model-space (``fully_reshardable``) conversion of the same state."""
    got = _convert(saved[0], fmt, str(tmp_path / "conv"))
    for theirs, mine in NAMES.items():
        for key, kind in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(got[key][0][mine], saved[1][theirs][kind]), (mine, key)
    assert got["exp_avg"][0]["decoder.1.attention.qkv.weight"].abs().max() > 0
    meta = got["master"][1]
    assert meta["optimizer"]["step"] == ITERATION and meta["iteration"] == ITERATION
    ref = _convert(saved[0], "fully_reshardable", str(tmp_path / "ref"))
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert sorted(got[key][0]) == sorted(ref[key][0])
        for name, t in ref[key][0].items():
            assert torch.equal(got[key][0][name], t), (key, name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_first_resumed_step_is_adam_from_the_saved_state(saved, fmt, tmp_path):
    """TP 1, then DP 2 with ZeRO-1: one step from the converted state is a float64 Adam step."""
    from test_megatron_optim_import import _adam_mismatch, _resume
    before, after, rows, meta = _resume(saved, fmt, tmp_path)
    assert meta["optimizer"]["step"] == ITERATION and [r["iteration"] for r in rows] == [ITERATION + 1]
    worst = _adam_mismatch(before, after, ITERATION)
    before, after, _, _ = _resume(saved, fmt, tmp_path / "dp2", ranks=2, zero_stage=1)
    worst_dp2 = _adam_mismatch(before, after, ITERATION)
    print(f"{fmt}: Adam step from the saved state: worst {worst:.3g} (TP 1), {worst_dp2:.3g} (DP 2) of "
          "its bound")
    assert worst <= 1.0 and worst_dp2 <= 1.0


@pytest.mark.slow
def test_unreconstructable_buffer_is_one_line_and_exit_2(saved, tmp_path, capsys, monkeypatch):
    """A main-weight buffer no stored weight matches (here: one element of distrib_optim.pt changed) is
    refused by name; --no-load-optim then starts a fresh optimizer."""
    from test_megatron_optim_import import _cli
    src = str(tmp_path / "src")
    shutil.copytree(os.path.join(saved[0], "legacy"), src)
    fpath = os.path.join(src, "iter_0000003", "mp_rank_00", "distrib_optim.pt")
    state = torch.load(fpath, weights_only=True)
    buf = next(iter(state[0].values()))["param"]
    buf[3000] += 1.0  # inside a weight: that weight no longer equals the buffer there
    torch.save(state, fpath)
    code, err = _cli(src, capsys, monkeypatch)
    assert code == 2 and len(err) == 1, err
    assert "distrib_optim.pt: no stored weight equals the distributed optimizer's main weights at " \
           "element" in err[0] and "pass --no-load-optim" in err[0], err[0]
    code, err = _cli(src, capsys, monkeypatch, "--no-load-optim")
    assert code == 0, err


# ---- the layout search alone (no megatron-core) -------------------------------------------------
def _units(weights):
    return _Units({k: (lambda v=v: v, tuple(v.shape), v.dtype) for k, v in weights.items()})


def _buffer(order, weights, gap=64):
    """Weights ``order`` laid out as megatron-core does: each start padded to ``gap`` elements."""
    parts, at = [], 0
    for name in order:
        pad = -at % gap
        parts += [torch.full((pad,), 7.0), weights[name].reshape(-1)]
        at += pad + weights[name].numel()
    return torch.cat(parts)


def test_layout_is_found_from_the_main_weights():
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(70, generator=g),
         "c": torch.randn(2, generator=g)}
    placed = place([_buffer(["c", "b", "a"], w)], _units(w), "x", joined=False)
    assert placed == {"c": (0, 0, 2), "b": (0, 64, 70), "a": (0, 192, 15)}
    # two buckets concatenated (legacy): "a" starts the second bucket right after "b", unaligned
    joined = torch.cat([_buffer(["c", "b"], w), _buffer(["a"], w)])
    assert place([joined], _units(w), "x", joined=True)["a"] == (0, 134, 15)
    with pytest.raises(CheckpointError, match="element 134 of bucket 0; its layout cannot be reconstructed"):
        place([joined], _units(w), "x", joined=False)


def test_equal_weights_or_a_changed_buffer_are_refused():
    g = torch.Generator().manual_seed(1)
    w = {"a": torch.randn(4, generator=g), "b": torch.randn(8, generator=g)}
    buf = _buffer(["b", "a"], w)
    buf[66] += 1.0  # inside "a"
    with pytest.raises(CheckpointError, match="no stored weight equals .* at element 8 of bucket 0"):
        place([buf], _units(w), "x", joined=False)
    w["c"] = w["a"].clone()
    with pytest.raises(CheckpointError, match="are equal, so the distributed optimizer's buffer cannot tell"):
        place([_buffer(["b", "a"], w)], _units(w), "x", joined=False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16_dp_reshardable", "bf16_legacy"])
def test_bf16_run_resumes_from_its_fp32_main_weights(saved, fmt, tmp_path):
    """bf16 weights: the layout is found from the fp32 main weights rounded to bf16; they (not the bf16
    weights) become megazero's masters, and the first bf16 step is Adam's from the saved state."""
    from test_megatron_optim_import import _adam_mismatch, _resume
    from megazero.checkpoint.megatron.files import MegatronCheckpoint
    before, after, _, _ = _resume(saved, fmt, tmp_path, bf16=True)
    assert _adam_mismatch(before, after, ITERATION) <= 1.0
    weights = MegatronCheckpoint(os.path.join(saved[0], fmt))
    stored = weights.tensor(*(("decoder.layers.1.self_attention.linear_qkv.weight",) if fmt.endswith("legacy")
                              else ("decoder.layers.self_attention.linear_qkv.weight", False, 1)))
    master = before[0]["decoder.1.attention.qkv.weight"]
    assert torch.equal(master.bfloat16().float(), stored) and not torch.equal(master, stored)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_tp2_state_is_megatron_cores_and_resumes(saved_tp2, fmt, tmp_path):
    """TP 2: each domain's (torch_dist ``dp_group_idx_<d>``; legacy: each rank's distrib_optim.pt)
    buffers are placed against that rank's weights (TP chunks; SwiGLU fc1 as gate over up) and joined as
    the weights are: equal to megatron-core's state on each rank; the step resumed at TP 1 is Adam's."""
    from test_megatron_optim_import import _adam_mismatch, _resume
    got = _convert(saved_tp2[0], fmt, str(tmp_path / "conv"))
    ranks = saved_tp2[1]
    for kind, key in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        qkv = torch.cat([r["decoder.layers.1.self_attention.linear_qkv.weight"][kind][2] for r in ranks])
        proj = [r["decoder.layers.2.self_attention.linear_proj.weight"][kind][2].view(32, 16) for r in ranks]
        assert torch.equal(got[key][0]["decoder.1.attention.qkv.weight"], qkv.view(64, 32))
        assert torch.equal(got[key][0]["decoder.2.attention.proj.weight"], torch.cat(proj, 1))
        assert torch.equal(got[key][0]["final_norm.weight"],
                           ranks[0]["decoder.final_layernorm.weight"][kind][2])
    if fmt == "dp_reshardable":  # every tensor, SwiGLU's fc1 included, as the legacy files give it
        ref = _convert(saved_tp2[0], "legacy", str(tmp_path / "ref"))
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for name, t in ref[key][0].items():
                assert torch.equal(got[key][0][name], t), (key, name)
    before, after, _, _ = _resume(saved_tp2, fmt, tmp_path / "resume")
    worst = _adam_mismatch(before, after, ITERATION)
    print(f"TP 2 {fmt}: Adam step from the saved state: worst {worst:.3g} of its bound")
    assert worst <= 1.0
