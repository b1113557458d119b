"""``--moe-apply-probs-on-input`` (Llama 4's routed experts): the routing weight scales the expert's input,
``out[t] = shared(x_t) + expert_e(p_te * x_t)`` for the one chosen expert ``e`` (top-1 sigmoid), and
the expert outputs add up unweighted.

- one MoE layer in float64 against a loop over tokens written here (output and every gradient, 1e-12:
  both sides float64, only the summation order differs), and the same loop with the weight on the
  output (Megatron's default) is far from it, so a dispatcher that weighs the output fails the test;
- both dispatchers across 2 forked ranks (EP 2) in float64 against the loop over both ranks' tokens;
  pad-to-capacity's weightless fillers add nothing even to biased experts;
- a tiny Llama-4-shaped model (dense and MoE layers interleaved, a shared expert, top-1 sigmoid) trained
  under EP 2 (2 ranks), EP 2 x TP 2 (expert TP 2) with sequence parallelism, PP 2 x DP 2 with ZeRO-1 and
  full recomputation, and CP 2 x DP 2 x EP 2 with ZeRO-3 and the grouped product (4 ranks) against one
  process: losses and gradient norms within R_TRAIN (fp32 SGD
  under another layout, tests/tolerance.py), tokens per expert equal; the same model weighing the
  output trains to losses over 100 x R_TRAIN away;
- the memory estimate of one such layer equals the bytes autograd keeps (fp32, bf16);
- top-k > 1 refused in one line naming the flag."""
import pytest
import torch
import torch.nn.functional as F

from megazero.config import ConfigError, config_from_dict, parse_args, validate
from megazero.mesh import ParallelMesh
from megazero.moe import GroupedExperts, MoEStats, build_dispatcher
from megazero.moe.routing import topk_routing
from megazero.process.local_ranks import run_ranks
from tolerance import R_TRAIN

TIGHT = dict(rtol=1e-12, atol=1e-12)
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
         "--disable-bias-linear", "--num-experts", "4", "--moe-ffn-hidden-size", "12", "--seq-length", "8",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--swiglu", "--moe-router-topk", "1",
         "--moe-router-score-function", "sigmoid", "--moe-apply-probs-on-input"]


def _run_expert(experts, j, rows):
    return (F.silu(rows @ experts.gate_weight[j].t()) * (rows @ experts.fc1_weight[j].t())) @ \
        experts.fc2_weight[j].t()


def _loop(layer, x, on_input=True):
    """Token by token: the top-1 sigmoid weight on the chosen expert's input (or output), plus the
    ungated shared expert."""
    logits = x @ layer.router.weight.t()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        e = int(torch.argmax(logits[t]))
        p = torch.sigmoid(logits[t, e])
        out[t] = _run_expert(layer.experts, e, p * x[t:t + 1])[0] if on_input else \
            p * _run_expert(layer.experts, e, x[t:t + 1])[0]
    sh = layer.shared_experts
    return out + sh.fc2(F.silu(sh.gate(x)) * sh.fc1(x))


def test_layer_weighs_the_input_against_a_loop():
    from models.moe import MoELayer
    cfg = parse_args(FLAGS + ["--moe-shared-expert-intermediate-size", "12"])
    layer = MoELayer(cfg, ParallelMesh.single(torch.device("cpu")), 1, MoEStats([1], 4, "cpu")).double()
    x = torch.randn(6, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    up = torch.randn(6, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = [p for p in layer.parameters() if p.requires_grad]
    with torch.no_grad():  # weights of std 0.2, not 0.02: the experts' nonlinearity shows
        for p in params:
            p.mul_(10)
    out = layer(x).reshape(12, 16)
    want = _loop(layer, x.reshape(12, 16))
    torch.testing.assert_close(out, want, **TIGHT)
    got = torch.autograd.grad((out * up.reshape(12, 16)).sum(), params)
    for g, w in zip(got, torch.autograd.grad((want * up.reshape(12, 16)).sum(), params)):
        torch.testing.assert_close(g, w, **TIGHT)
    router = next(i for i, p in enumerate(params) if p is layer.router.weight)
    assert float(got[router].abs().max()) > 0  # the router learns through the input's weight
    with torch.no_grad():  # weighing the output is another layer: off by a good part of the routed output
        on_output = _loop(layer, x.reshape(12, 16), on_input=False)
        routed = want - layer.shared_experts(x.reshape(12, 16))
        assert float((on_output - want).abs().max()) > 0.1 * float(routed.abs().max()) > 0


def _dispatch_rank(kind):
    mesh = ParallelMesh.build(ep=2)
    cfg = parse_args(FLAGS + ["--expert-model-parallel-size", "2"], world_size=2)
    experts = GroupedExperts(cfg, mesh, 1).double()
    whole = GroupedExperts(parse_args(FLAGS), ParallelMesh.single(torch.device("cpu")), 1).double()

    def tokens(r):
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(10, 16, dtype=torch.float64, generator=g)
        probs, rmap = topk_routing(torch.randn(10, 4, dtype=torch.float64, generator=g), 1, "sigmoid")
        return x, probs, rmap, torch.randn(10, 16, dtype=torch.float64, generator=g)
    x, probs, rmap, up = tokens(mesh.rank)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    out = build_dispatcher(kind, mesh, 4, probs_on_input=True)(x, probs, rmap, experts)
    grads = torch.autograd.grad((out * up).sum(), [x, probs])
    objective, mine = 0.0, None
    for r in range(2):
        xr, pr, mr, ur = tokens(r)
        xr.requires_grad_(r == mesh.rank)
        pr.requires_grad_(r == mesh.rank)
        o = torch.stack([_run_expert(whole, int(mr[t].nonzero()), pr[t, mr[t]] * xr[t:t + 1])[0]
                         for t in range(10)])
        objective = objective + (o * ur).sum()
        if r == mesh.rank:
            mine = (o, xr, pr)
    want = torch.autograd.grad(objective, [mine[1], mine[2]])
    return [float((out - mine[0]).detach().abs().max())] + [float((a - b).abs().max())
                                                            for a, b in zip(grads, want)]


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_dispatchers_across_two_ranks_weigh_the_input(kind):
    for errors in run_ranks(_dispatch_rank, 2, kind, timeout=120):
        assert max(errors) <= 1e-11, errors


def test_weightless_fillers_add_nothing_with_biased_experts():
    """Pad-to-capacity fills experts with pairs of weight 0: their input is zero, but a biased expert's
    output on zero is not, and the combine must leave it out (as weighing the output would)."""
    cfg = parse_args([f for f in FLAGS if f != "--disable-bias-linear"])
    experts = GroupedExperts(cfg, ParallelMesh.single(torch.device("cpu")), 1).double()
    with torch.no_grad():
        for b in (experts.fc1_bias, experts.gate_bias, experts.fc2_bias):
            b.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 16, dtype=torch.float64, generator=g)
    probs, rmap = topk_routing(torch.randn(6, 4, dtype=torch.float64, generator=g), 1, "sigmoid")
    filler = ~rmap & (torch.arange(4) == 0)  # every token not routed to expert 0 fills it, weight 0
    out = build_dispatcher("alltoall", ParallelMesh.single(torch.device("cpu")), 4,
                           probs_on_input=True)(x, probs, rmap | filler, experts)

    def run(j, rows):
        h = F.silu(rows @ experts.gate_weight[j].t() + experts.gate_bias[j]) * \
            (rows @ experts.fc1_weight[j].t() + experts.fc1_bias[j])
        return h @ experts.fc2_weight[j].t() + experts.fc2_bias[j]
    want = torch.stack([run(int(rmap[t].nonzero()), probs[t, rmap[t]] * x[t:t + 1])[0] for t in range(6)])
    assert int(filler.sum()) > 0 and float(run(0, x[:1] * 0).detach().abs().max()) > 0.1
    torch.testing.assert_close(out, want, **TIGHT)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_memory_estimate_counts_what_the_layer_keeps(bf16):
    """One MoE layer's forward (padded capacity: the pairs are known): the bytes autograd keeps equal
    models.saved_activations.moe_bytes, the weighted input and the combine's 0/1 weights included."""
    from megazero.planning.activations import dims, layer_dims
    from megazero.training.measure import SavedTensorTracker
    from models.moe import MoELayer
    from models.saved_activations import moe_bytes
    from test_memory import cfg_of
    from test_memory_moe import MOE
    cfg = cfg_of(1, **dict(MOE, moe_layer_freq=1, moe_router_topk=1, moe_router_score_function="sigmoid",
                           moe_apply_probs_on_input=True, **({"bf16": True} if bf16 else {})))
    dtype = torch.bfloat16 if bf16 else torch.float32
    layer = MoELayer(cfg, ParallelMesh.single(torch.device("cpu")), 0, MoEStats([0], 8, "cpu")).to(dtype)
    tracker = SavedTensorTracker({p.untyped_storage().data_ptr() for p in layer.parameters()})
    with tracker:
        layer(torch.randn(16, 2, 32, dtype=dtype, requires_grad=True))
    D = layer_dims(cfg, dims(cfg, "cpu"), 0)
    assert D.moe.probs_on_input and tracker.peak == moe_bytes(D) > 0


def test_topk_above_one_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--moe-apply-probs-on-input needs --moe-router-topk 1, got 2"):
        parse_args(FLAGS + ["--moe-router-topk", "2"])
    with pytest.raises(ConfigError, match=r"--moe-apply-probs-on-input needs --num-experts"):
        validate(config_from_dict(dict(LLAMA4, num_experts=None, moe_shared_expert_intermediate_size=None)),
                 world_size=1)


# ---- a tiny Llama-4-shaped model under parallel layouts ------------------------------------------
LLAMA4 = dict(mock_data=True, num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
              vocab_size=100, global_batch_size=4, micro_batch_size=1, train_iters=3, lr_decay_iters=4,
              optimizer="sgd", lr=0.05, sgd_momentum=0.0, init_method_std=0.2, log_interval=100,
              hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm",
              activation="swiglu",
              position_embedding_type="rope", num_experts=4, moe_router_topk=1, moe_layer_freq="[0,1,0,1]",
              moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
              moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
              moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall")
KEYS = ("loss", "grad_norm")
COUNTS = ("moe_tokens_per_expert_min", "moe_tokens_per_expert_max")
LAYOUTS = {  # name: (world, settings)
    "ep2-allgather": (2, dict(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather")),
    "ep2-tp2-sp": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                           sequence_parallel=True)),
    "pp2-dp2-zero1-recompute": (4, dict(pipeline_model_parallel_size=2, zero_stage=1,
                                        recompute_granularity="full", recompute_method="uniform",
                                        recompute_num_layers=1)),
    "cp2-dp2-ep2-zero3-grouped": (4, dict(context_parallel_size=2, expert_model_parallel_size=2, zero_stage=3,
                                          moe_grouped_gemm=True)),
}


def _train(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


@pytest.fixture(scope="module")
def one_process():
    return _train(config_from_dict(dict(LLAMA4)))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_llama4_moe_layout_matches_one_process(name, one_process):
    world, layout = LAYOUTS[name]
    ranks = run_ranks(_train, world, config_from_dict(dict(LLAMA4, **layout)), timeout=300)
    for hist in ranks:
        for key in KEYS:
            assert [m[key] for m in hist] == pytest.approx([m[key] for m in one_process], rel=R_TRAIN), key
        for key in COUNTS:
            assert [m[key] for m in hist] == [m[key] for m in one_process], key


@pytest.mark.slow
def test_the_flag_changes_the_training(one_process):
    """The same model with the weight on the output trains to other losses, far outside the layouts'
    bound (the flag reaches the model; init std 0.2 so that the experts' nonlinearity shows)."""
    other = _train(config_from_dict(dict(LLAMA4, moe_apply_probs_on_input=False)))
    gap = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(other, one_process))
    assert gap > 100 * R_TRAIN, gap


def test_modelopt_spelling_sets_the_flag():
    base = [f for f in FLAGS if f != "--moe-apply-probs-on-input"]
    assert not parse_args(base).moe.moe_apply_probs_on_input
    assert parse_args(base + ["--export-moe-apply-probs-on-input"]).moe.moe_apply_probs_on_input


def test_flag_validates():
    cfg = validate(config_from_dict(dict(LLAMA4)), world_size=1)
    assert cfg.moe.moe_apply_probs_on_input and cfg.moe.moe_router_topk == 1
