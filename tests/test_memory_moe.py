"""The memory model of a mixture of experts: expert parameters sharded over expert DP, and what an MoE
layer keeps for backward, estimated and measured.

The measured runs use a capacity with padding (``--moe-expert-capacity-factor 1.5
--moe-pad-expert-input-to-capacity``) and no sequence or context split of the router's tokens: every
expert then runs exactly its capacity of rows and each rank routes exactly ``E x capacity`` pairs, so the
estimate, which assumes balanced routing, is exact and is held to equality.  (A dropless router's
rows per expert depend on the data, and the padded ``bmm`` pads every expert to the longest; under
sequence parallelism the padding fillers go to the earliest tokens, so one TP rank routes more pairs
than another.  The estimate is then an expectation: ``docs/planning.md``.)"""
import pytest

from megazero.process.local_ranks import run_ranks
from megazero.planning.activations import dims, layer_dims
from megazero.planning.estimate import estimate_stages, stage_params
from test_memory import LLAMA, GPT2, SAVED, cfg_of

MOE = dict(LLAMA, num_experts=8, moe_router_topk=2, moe_layer_freq="([0]*1+[1]*1)*2", moe_ffn_hidden_size=24,
           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, moe_aux_loss_coeff=1e-2,
           moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True,
           micro_batch_size=2)

LAYOUTS = {
    "ep2-dp2-zero1": dict(MOE, expert_model_parallel_size=2, zero_stage=1, global_batch_size=8),
    "ep2-dp2-zero3": dict(MOE, expert_model_parallel_size=2, zero_stage=3, global_batch_size=8),
    "pp2-ep2-full-bf16-zero2": dict(MOE, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                    recompute_granularity="full", bf16=True, zero_stage=2,
                                    global_batch_size=8),
    "ep4-allgather-gelu-bias-zero1": dict(GPT2, **{k: v for k, v in MOE.items() if k.startswith("moe_")},
                                          num_experts=8, micro_batch_size=2, expert_model_parallel_size=4,
                                          moe_token_dispatcher_type="allgather", zero_stage=1,
                                          global_batch_size=8),
}


def _measure(settings):
    import models
    from megazero.training.measure import measure_rank
    return measure_rank(cfg_of(4, **settings), models.build_chunks, iters=1)


def _count(settings):
    import models
    from megazero.mesh import ParallelMesh
    cfg = cfg_of(4, **settings)
    par = cfg.parallel
    mesh = ParallelMesh.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                              ep=cfg.moe.expert_model_parallel_size)
    return mesh.coord("pp"), sum(p.numel() for c in models.build_chunks(cfg, mesh) for p in c.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_moe_estimate_equals_measurement(name):
    """Model state (expert buckets over expert DP: 2 ranks at EP 2 on 4, 1 at EP 4) and activations
    equal what the ranks hold and autograd keeps, per pipeline stage; the gradient peak bounds the
    measured one."""
    settings = LAYOUTS[name]
    cfg = cfg_of(4, **settings)
    est = {r["pp_rank"]: r for r in estimate_stages(cfg, device="cpu", backend="gloo", saved=SAVED)}
    for m in run_ranks(_measure, 4, settings):
        e = est[m["pp_rank"]]
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes"):
            assert e[key] == m[key], (name, m["rank"], key, e[key], m[key])
        # an upper bound: it assumes no reduction finishes before the next is launched
        assert m["grad_bytes"] <= m["peak_grad_bytes"] <= e["peak_grad_bytes"], (name, m)
        assert m["saved_param_bytes"] == 0, (name, m)


def test_moe_stage_params_match_the_built_model():
    settings = dict(MOE, pipeline_model_parallel_size=2, expert_model_parallel_size=2, global_batch_size=8)
    cfg = cfg_of(4, **settings)
    for pp_rank, n in run_ranks(_count, 4, settings):
        assert n == stage_params(cfg, pp_rank, saved=SAVED)


def test_expert_bytes_are_sharded_over_expert_dp_under_zero():
    """8 ranks, EP 2: the dense parameters shard 8 ways, the experts 4 ways (their expert-DP group);
    at EP 8 the experts are not sharded at all (expert DP 1), so ZeRO-1 saves nothing on them."""
    from megazero.planning.model_state import EXPERT, plan_buckets, rank_chunks
    for ep, edp in ((2, 4), (8, 1)):
        cfg = cfg_of(8, **dict(MOE, expert_model_parallel_size=ep, global_batch_size=16))
        assert cfg.moe.expert_data_parallel_size == edp
        buckets = plan_buckets(cfg, rank_chunks(cfg, 0, SAVED), 1)
        expert = [b for b in buckets if b.kind == EXPERT]
        assert expert and all(b.group == edp and b.numel % edp == 0 for b in expert)
        assert all(b.group == 8 for b in buckets if b.kind != EXPERT)
        (row,) = estimate_stages(cfg, 1, device="cpu", saved=SAVED)
        optim = 8 * sum(b.numel // b.group for b in buckets)  # fp32 Adam: two moments, params are the master
        assert row["optim_bytes"] == optim


ROUTERS = {"softmax": {}, "bf16": dict(bf16=True), "no-gate": dict(moe_shared_expert_gate=False),
           "no-shared-bf16": dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                                  bf16=True),
           "seq-aux": dict(moe_router_load_balancing_type="seq_aux_loss"),
           "sigmoid": dict(moe_router_score_function="sigmoid"),
           "pre-softmax": dict(moe_router_pre_softmax=True),
           "no-losses": dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None),
           "gelu-bias": dict(activation="gelu", add_bias_linear=True, normalization="LayerNorm")}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_one_moe_layer_keeps_what_the_estimate_says(name):
    """One MoE layer's forward in one process (router, dispatch, grouped experts, combine, shared expert
    and gate): the bytes autograd keeps equal :func:`models.saved_activations.moe_bytes`, for each
    router, loss, precision and expert shape; the router's choice moves no byte (padded capacity)."""
    import torch
    from megazero.mesh import ParallelMesh
    from megazero.moe import MoEStats
    from megazero.training.measure import SavedTensorTracker
    from models.moe import MoELayer
    from models.saved_activations import moe_bytes
    settings = {k: v for k, v in dict(MOE, moe_layer_freq=1, **ROUTERS[name]).items() if v is not None}
    cfg = cfg_of(1, **settings)
    layer = MoELayer(cfg, ParallelMesh.single(torch.device("cpu")), 0, MoEStats([0], 8, "cpu"))
    dtype = torch.bfloat16 if cfg.precision.bf16 else torch.float32
    layer = layer.to(dtype).train()
    tracker = SavedTensorTracker({p.untyped_storage().data_ptr() for p in layer.parameters()})
    x = torch.randn(16, 2, 32, dtype=dtype, requires_grad=True)
    with tracker:
        layer(x)
    D = layer_dims(cfg, dims(cfg, "cpu"), 0)
    assert D.moe is not None and D.moe.pairs == 8 * 12  # E x ceil(1.5 x 2 x 32 / 8)
    assert tracker.peak == moe_bytes(D) > 0


def test_estimate_memory_script_reports_the_expert_layout(capsys):
    import json
    import models
    from megazero.config import parse_args
    from megazero.planning.model_state import plan_buckets, rank_chunks
    from models.cli import estimate_memory_main
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--vocab-size", "300", "--swiglu", "--disable-bias-linear", "--num-experts", "8",
             "--moe-router-topk", "2", "--expert-model-parallel-size", "4"]
    assert estimate_memory_main(["--world-size", "8", "--json"] + model) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["expert_model_parallel_size"], data["expert_data_parallel_size"]) == (4, 2)
    assert data["active_params"] < data["total_params"]
    cfg = parse_args(model, presets=models.PRESETS, world_size=8, check_data=False)
    shards = sum(b.numel // b.group for b in plan_buckets(cfg, rank_chunks(cfg, 0, SAVED), 1))
    assert data["stages"][1]["optim_bytes"] == 8 * shards  # fp32 Adam's moments: experts' shards over 2
    assert estimate_memory_main(["--world-size", "8"] + model) == 0
    assert "EP 4 x expert TP 1 x expert DP 2" in capsys.readouterr().out
    assert estimate_memory_main(["--world-size", "8"] + model[:-1] + ["3"]) == 2
    assert "--expert-model-parallel-size" in capsys.readouterr().err
