"""The planner and a mixture of experts: expert parallelism searched where the model has experts,
expert parameters sharded over expert DP, the all-to-all in the step time, and layouts that validate."""
import json
import os
import subprocess
import sys

import pytest

import models
from megazero.config import parse_args
from megazero.planning.planner import GB, enumerate_layouts, layout_config, peak_memory, plan, step_time
from megazero.planning.report import describe, flags
from test_planner import SAVED, base, hw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# experts dominate: 16 experts of 3 x 512 x 2048 in each of 4 layers (~200M parameters of ~206M)
MOE = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--vocab-size", "1000",
       "--swiglu", "--disable-bias-linear", "--num-experts", "16", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "2048"]
FEW = dict(micro_batch_sizes=[1], recompute=("none",), zero_stages=(1,))  # a small search


def _validates(x, cfg, gpus):
    """The layout's flags parse into the layout's config, whose memory is the one reported."""
    parsed = parse_args(flags(x, MOE, cfg) + ["--mock-data"], presets=models.PRESETS, world_size=gpus)
    assert parsed.moe.expert_model_parallel_size == x.ep
    assert parsed.moe.expert_tensor_parallel_size == (x.etp or x.tp)
    assert peak_memory(parsed, saved=SAVED) == x.memory_bytes
    return parsed


def test_expert_parallel_sizes_are_searched_only_where_the_model_has_experts():
    cfg = base(seq=256, gbs=16, args=MOE)
    layouts = list(enumerate_layouts(cfg, 8, 8, **FEW))
    assert {x.ep for x in layouts} == {1, 2, 4, 8}
    for x in layouts:
        etp = x.etp or x.tp
        assert 16 % x.ep == 0 and 8 % (etp * x.ep * x.pp) == 0
        assert x.tp == 1 or x.sequence_parallel  # MoE under TP needs sequence parallelism
    assert any(x.etp == 1 and x.tp > 1 for x in layouts)
    dense = base(seq=256, gbs=16)
    assert {x.ep for x in enumerate_layouts(dense, 8, 8, **FEW)} == {1}


def test_moe_gets_expert_parallelism_when_replicated_experts_do_not_fit():
    """At ZeRO-1 the optimizer state is sharded over DP, but every rank keeps its experts' bf16
    weights and fp32 gradients: with the memory of the leanest layout without EP, less 3%, only
    layouts that split the experts fit, and the fastest of them validates with its own flags."""
    cfg = base(seq=256, gbs=16, args=MOE)
    roomy = plan(cfg, 8, hw(80.0), margin=0.0, saved=SAVED, **FEW)
    assert {x.ep for x in roomy} > {1}
    least = min(x.memory_bytes for x in roomy if x.ep == 1)
    tight = plan(cfg, 8, hw(least / GB * 0.97), margin=0.0, saved=SAVED, **FEW)
    assert tight and all(x.ep > 1 for x in tight)
    best = tight[0]
    assert f"EP {best.ep}" in describe(best) and best.memory_bytes <= 0.97 * least
    _validates(best, cfg, 8)
    for x in tight[:10]:  # every proposed layout validates (the search's own config, and its flags)
        lc = layout_config(cfg, x, 8)
        assert lc.moe.expert_data_parallel_size * x.ep * (x.etp or x.tp) * x.pp == 8
        _validates(x, cfg, 8)


def test_the_all_to_all_is_in_the_step_time_and_ep_is_proposed_when_it_is_faster():
    """EP 2 on one node: per micro-batch and MoE layer four all-to-alls (tokens out and back, forward
    and backward) of the rank's routed rows (tokens x top-k x hidden, bf16), half of them leaving the
    rank.  With large experts EP's smaller expert-gradient reductions outweigh it and the fastest
    layout uses EP; with small experts (64 wide) and 2048-token sequences the all-to-all costs more
    than it saves and the fastest layout has none."""
    cfg = base(seq=256, gbs=16, args=MOE)
    layouts = [x for x in enumerate_layouts(cfg, 8, 8, **FEW) if x.tp == 1 and x.pp == 1 and x.etp is None]
    one, two = (next(x for x in layouts if x.ep == ep) for ep in (1, 2))
    fast = hw(80.0)
    t1, t2 = (step_time(layout_config(cfg, x, 8), fast, saved=SAVED) for x in (one, two))
    assert t1["ep_comm_s"] == 0.0
    rows = 256 * 1 * 2 * 512 * 2  # tokens x k x hidden x bf16 bytes
    per_layer = 4 * (2 - 1) * fast.intra.p2p(rows / 2)
    n_micro = 16 // 8
    assert t2["ep_comm_s"] == pytest.approx(n_micro * 4 * per_layer, rel=1e-12)
    assert t2["step_time_s"] == pytest.approx(sum(v for k, v in t2.items() if k != "step_time_s"), rel=1e-12)
    best = plan(cfg, 8, fast, margin=0.0, saved=SAVED, **FEW)[0]
    assert best.ep > 1 and best.step["ep_comm_s"] > 0
    small = base(seq=2048, gbs=16, args=[a if a != "2048" else "64" for a in MOE])
    found = plan(small, 8, fast, margin=0.0, saved=SAVED, **FEW)
    assert found[0].ep == 1 and any(x.ep > 1 for x in found)


def test_expert_gradients_reduce_over_expert_dp_in_the_step_time():
    """EP 8 on 8 ranks leaves each expert on one rank (expert DP 1): only the dense parameters'
    gradients cross the data-parallel group, so its DP time is far below EP 1's."""
    cfg = base(seq=256, gbs=16, args=MOE)
    layouts = [x for x in enumerate_layouts(cfg, 8, 8, **FEW) if x.tp == 1 and x.pp == 1]
    one, eight = (next(x for x in layouts if x.ep == ep) for ep in (1, 8))
    t1, t8 = (step_time(layout_config(cfg, x, 8), hw(80.0), saved=SAVED) for x in (one, eight))
    assert 0 < t8["dp_comm_s"] < 0.1 * t1["dp_comm_s"]


@pytest.mark.slow
def test_plan_script_proposes_expert_parallelism():
    args = ["--json", "--gpus", "8", "--gpu", "H100", "--global-batch-size", "16", "--seq-length", "256",
            "--zero-stages", "1", "--micro-batch-sizes", "1", "--recompute", "none", "--top", "50", *MOE]
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert {d["ep"] for d in data} > {1}
    for d in data[:5]:
        cfg = parse_args(d["flags"].split() + ["--mock-data"], presets=models.PRESETS, world_size=8)
        assert cfg.moe.expert_model_parallel_size == d["ep"]


MIXED = ["--moe-layer-freq", "2", "--moe-shared-expert-intermediate-size", "512"]


@pytest.mark.parametrize("extra, biased", [([], False), (MIXED, False), ([], True)],
                         ids=["plain", "mixed-shared", "biased"])
def test_every_enumerated_moe_layout_validates(extra, biased):
    """Every layout the search enumerates for an MoE model is a valid configuration (with CP too); biased
    experts are only ever whole on a rank under TP (expert TP 1, Megatron-LM's rule)."""
    model = [a for a in MOE if not (biased and a == "--disable-bias-linear")]
    cfg = base(seq=256, gbs=16, args=model + extra + ["--attention-dropout", "0"])
    assert cfg.model.add_bias_linear == biased
    seen = set()
    for cp in (False, True):
        for x in enumerate_layouts(cfg, 8, 8, context_parallel=cp, **FEW):
            lc = layout_config(cfg, x, 8)
            seen.add((x.ep, x.etp, x.cp > 1))
            assert not biased or x.tp == 1 or lc.moe.expert_tensor_parallel_size == 1
    assert {ep for ep, _, _ in seen} == {1, 2, 4, 8} and any(cp for _, _, cp in seen)
