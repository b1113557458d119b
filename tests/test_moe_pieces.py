"""Each piece of the MoE layer alone against a float64 loop over tokens and experts: the routing
functions, capacity, the auxiliary losses, the grouped product, a rank's experts, the whole layer in
one process, and the dispatchers across expert-parallel ranks.

Everything runs in float64 (the pieces accept it: scores follow the logits' dtype), so the reference
and the vectorised code differ only by summation order: 1e-12 relative leaves a margin of ~1e3 over
``n * 2^-53`` for the sums here (n <= 256) and still fails an error of one part in a million."""
import math

import pytest
import torch
import torch.nn.functional as F

from megazero.config import parse_args
from megazero.process.local_ranks import run_ranks
from megazero.mesh import ParallelMesh
from megazero.moe import GroupedExperts, MoEStats, build_dispatcher, grouped_product
from megazero.moe.routing import (apply_capacity, aux_loss_scores, expert_capacity, seq_aux_loss,
                                  switch_aux_loss, topk_routing, z_loss)

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _logits(t=24, e=8, seed=0):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- routing -------------------------------------------------------------------------------------
def _route_loop(logits, k, score, pre, scale, bias):
    t, e = logits.shape
    probs, chosen = torch.zeros(t, e, dtype=torch.float64), torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        row = [float(v) for v in logits[i]]
        if score == "softmax" and pre:
            z = sum(math.exp(v) for v in row)
            s = [math.exp(v) / z for v in row]
            top = sorted(range(e), key=lambda j: -s[j])[:k]
            w = {j: s[j] for j in top}
        elif score == "softmax":
            top = sorted(range(e), key=lambda j: -row[j])[:k]
            z = sum(math.exp(row[j]) for j in top)
            w = {j: math.exp(row[j]) / z for j in top}
        else:
            s = [1 / (1 + math.exp(-v)) for v in row]
            key = [s[j] + (float(bias[j]) if bias is not None else 0.0) for j in range(e)]
            top = sorted(range(e), key=lambda j: -key[j])[:k]
            z = sum(s[j] for j in top) if k > 1 else 1.0
            w = {j: s[j] / z for j in top}
        for j, v in w.items():
            probs[i, j], chosen[i, j] = v * (scale or 1.0), True
    return probs, chosen


@pytest.mark.parametrize("score,pre,scale,bias,k", [("softmax", False, None, False, 2),
                                                    ("softmax", True, 2.5, False, 2),
                                                    ("sigmoid", False, None, False, 2),
                                                    ("sigmoid", False, 1.5, True, 3),
                                                    ("sigmoid", False, None, False, 1)])
def test_topk_routing_against_a_loop(score, pre, scale, bias, k):
    logits = _logits()
    b = torch.linspace(-0.3, 0.3, 8, dtype=torch.float64) if bias else None
    probs, routing_map = topk_routing(logits, k, score, pre, scale, b)
    want_p, want_m = _route_loop(logits, k, score, pre, scale, b)
    assert torch.equal(routing_map, want_m)
    torch.testing.assert_close(probs, want_p, **TIGHT)
    if bias:  # the bias moves the choice, never the weights: some token's choice changed
        assert not torch.equal(routing_map, topk_routing(logits, k, score, pre, scale, None)[1])


def test_load_balancing_losses_against_the_formula():
    logits = _logits(t=6 * 4)  # 6 positions x 4 sequences, sequence-major
    k, e = 2, 8
    scores, top = aux_loss_scores(logits, k, "softmax")
    f = [sum(bool(top[t, j]) for t in range(24)) for j in range(e)]
    p = [sum(float(scores[t, j]) for t in range(24)) for j in range(e)]
    want = e / (k * 24 * 24) * sum(f[j] * p[j] for j in range(e))
    got = switch_aux_loss(scores, top.sum(0), 24, k)
    assert abs(float(got) - want) <= 1e-12 * want
    # a share of the tokens with the counts of all: the shares add up to the whole
    halves = [switch_aux_loss(scores[a:a + 12], top.sum(0), 24, k) for a in (0, 12)]
    assert abs(float(sum(halves)) - want) <= 1e-12 * want
    # per sequence: sequence j holds rows j, j + 4, j + 8, ... (positions are the slow index)
    per_seq = []
    for j in range(4):
        rows = list(range(j, 24, 4))
        fs = [sum(bool(top[t, x]) for t in rows) for x in range(e)]
        ps = [sum(float(scores[t, x]) for t in rows) for x in range(e)]
        per_seq.append(e / (k * 6 * 6) * sum(fs[x] * ps[x] for x in range(e)))
    got = seq_aux_loss(scores.view(6, 4, e), top.view(6, 4, e).sum(0), 6, k)
    assert abs(float(got) - sum(per_seq) / 4) <= 1e-12 * sum(per_seq)
    want_z = sum(math.log(sum(math.exp(float(v)) for v in row)) ** 2 for row in logits) / 24
    assert abs(float(z_loss(logits)) - want_z) <= 1e-12 * want_z


def _capacity_loop(probs, routing_map, cap, policy, pad):
    t, e = probs.shape
    kept = torch.zeros_like(routing_map)
    for j in range(e):
        tokens = [i for i in range(t) if routing_map[i, j]]
        if policy == "probs":
            tokens = sorted(tokens, key=lambda i: (-float(probs[i, j]), i))
        for i in tokens[:cap]:
            kept[i, j] = True
    final = kept.clone()
    if pad:
        for j in range(e):
            free = [i for i in range(t) if not kept[i, j]]
            for i in free[:cap - int(kept[:, j].sum())]:
                final[i, j] = True
    return probs * kept, kept, final


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_against_a_loop(policy, pad):
    probs, routing_map = topk_routing(_logits(t=32, seed=3) * 2, 2)
    cap = expert_capacity(32, 8, 2, 1.0)
    assert cap == 8
    got = apply_capacity(probs, routing_map, cap, policy, pad)
    want = _capacity_loop(probs, routing_map, cap, policy, pad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert int(got[1].sum()) < int(routing_map.sum())  # something was dropped at this capacity
    if pad:
        assert torch.equal(got[2].sum(0), torch.full((8,), cap))


# ---- the grouped product and a rank's experts -----------------------------------------------------
@pytest.mark.parametrize("backend", ["bmm", "loop"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [4, 4, 4, 4], [0, 0, 7, 0]])
def test_grouped_product_against_a_loop(counts, backend):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(4, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, generator=g, requires_grad=True)
    y = grouped_product(x, w, counts, b, backend=backend)
    parts, start = [], 0
    for j, c in enumerate(counts):
        parts.append(x[start:start + c] @ w[j].t() + b[j])
        start += c
    want = torch.cat(parts)
    torch.testing.assert_close(y, want, **TIGHT)
    up = torch.randn(y.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(y, (x, w, b), up)
    wants = torch.autograd.grad(want, (x, w, b), up)
    for a, c in zip(grads, wants):
        torch.testing.assert_close(a, c, **TIGHT)


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no grouped_mm")
def test_grouped_mm_backend_agrees():
    """torch's grouped_mm (fp32 only here: it takes no float64): within one fp32 product's rounding."""
    counts = [4, 0, 8, 4]
    x, w = torch.randn(16, 8), torch.randn(4, 8, 8)
    y = grouped_product(x, w, counts, backend="grouped_mm")
    want = grouped_product(x.double(), w.double(), counts, backend="bmm")
    bound = 8 * 2 ** -24 * float((x.abs() @ w.abs().amax(0).t()).max())  # 8 products, one rounding each
    torch.testing.assert_close(y.double(), want, rtol=0, atol=bound)


def _cfg(extra=(), world=1):
    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--disable-bias-linear", "--num-experts", "8", "--moe-ffn-hidden-size", "12", "--seq-length", "8",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    return parse_args(base + list(extra), world_size=world)


def _expert_loop(experts, x, activation="swiglu"):
    """Expert j of a GroupedExperts applied to rows x, one expert at a time."""
    def run(j, rows):
        h = rows @ experts.fc1_weight[j].t()
        if activation == "swiglu":
            h = F.silu(rows @ experts.gate_weight[j].t()) * h
        elif activation == "geglu":  # Gemma's: the tanh GELU of the gate
            h = F.gelu(rows @ experts.gate_weight[j].t(), approximate="tanh") * h
        else:
            h = F.gelu(h)
        return h @ experts.fc2_weight[j].t()
    return run


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu_exact"])
def test_grouped_experts_against_a_loop(activation, grouped):
    """With --moe-grouped-gemm one grouped product (bmm here), without it one product per expert."""
    cfg = _cfg(["--activation", activation] + (["--moe-grouped-gemm"] if grouped else []))
    experts = GroupedExperts(cfg, ParallelMesh.single(torch.device("cpu")), 1).double()
    assert experts.backend == ("auto" if grouped else "loop")
    assert (experts.gate_weight is None) == (activation == "gelu_exact")
    counts = [2, 0, 3, 1, 0, 4, 1, 1]
    x = torch.randn(12, 16, dtype=torch.float64)
    run = _expert_loop(experts, x, activation)
    parts, start = [], 0
    for j, c in enumerate(counts):
        parts.append(run(j, x[start:start + c]))
        start += c
    torch.testing.assert_close(experts(x, counts), torch.cat(parts), **TIGHT)


def test_expert_init_is_keyed_by_expert_index():
    """Expert e's weights are the same whichever EP rank holds it (init keyed by (seed, layer, name, e))."""
    cfg = _cfg(["--expert-model-parallel-size", "2"], world=2)
    whole = GroupedExperts(_cfg(), ParallelMesh.single(torch.device("cpu")), 1)

    class Half:  # a mesh stand-in: EP rank 1 of 2
        device = torch.device("cpu")

        def size(self, axis):
            return {"ep": 2, "etp": 1}[axis]

        def coord(self, axis):
            return {"ep": 1, "etp": 0}[axis]
    half = GroupedExperts(cfg, Half(), 1)
    assert torch.equal(half.fc1_weight, whole.fc1_weight[4:])
    assert torch.equal(half.fc2_weight, whole.fc2_weight[4:])
    assert half.fc1_weight.expert_parallel and half.fc1_weight.partition_dim == 1


# ---- the whole layer, one process -----------------------------------------------------------------
def _layer(extra=()):
    from models.moe import MoELayer
    cfg = _cfg(["--swiglu", "--moe-shared-expert-intermediate-size", "20", "--moe-shared-expert-gate",
                "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01", *extra])
    stats = MoEStats([1], 8, "cpu")
    return MoELayer(cfg, ParallelMesh.single(torch.device("cpu")), 1, stats).double(), stats, cfg


def _layer_loop(layer, x, cfg):
    """transformers-Mixtral-style reference: per token, per chosen expert; plus the shared expert."""
    k = cfg.moe.moe_router_topk
    logits = x @ layer.router.weight.t()
    out = torch.zeros_like(x)
    run = _expert_loop(layer.experts, x)
    for t in range(x.shape[0]):
        top = torch.topk(logits[t], k).indices
        w = torch.softmax(logits[t, top], dim=0)
        for j, e in enumerate(top.tolist()):
            out[t] = out[t] + w[j] * run(e, x[t:t + 1])[0]
    sh = layer.shared_experts
    shared = sh.fc2(F.silu(sh.gate(x)) * sh.fc1(x)) * torch.sigmoid(x @ layer.shared_gate_weight.t())
    scores = torch.softmax(logits, dim=-1)
    top = torch.zeros_like(scores).scatter(1, torch.topk(scores, k, dim=1).indices, 1.0)
    aux = 8 / (k * x.shape[0] ** 2) * (top.sum(0) * scores.sum(0)).sum()
    zl = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return out + shared, aux, zl


def test_moe_layer_one_process_against_a_loop():
    layer, stats, cfg = _layer()
    x = torch.randn(4, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    up = torch.randn(4, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params = [p for p in layer.parameters() if p.requires_grad]
    out = layer(x)
    got = torch.autograd.grad((out * up).sum(), params)  # + aux and z losses, through their backward
    want, aux, zl = _layer_loop(layer, x.reshape(8, 16), cfg)
    torch.testing.assert_close(out.reshape(8, 16), want, **TIGHT)
    assert abs(float(stats.aux_loss[1]) - float(aux.detach())) <= 1e-12
    assert abs(float(stats.z_loss[1]) - float(zl.detach())) <= 1e-12
    objective = (want * up.reshape(8, 16)).sum() + 0.1 * aux + 0.01 * zl
    for g, w, p in zip(got, torch.autograd.grad(objective, params), params):
        torch.testing.assert_close(g, w, **TIGHT)
    assert int(stats.tokens[1].sum()) == 8 * 2 and int(stats.dropped[1]) == 0


def test_aux_loss_gradient_takes_the_backward_scale():
    layer, stats, _ = _layer(["--moe-z-loss-coeff", "0"])
    x = torch.randn(4, 2, 16, dtype=torch.float64)
    w = layer.router.weight
    g1 = torch.autograd.grad(layer(x).sum() * 0, w)[0]  # the aux loss's gradient alone
    stats.backward_scale = 0.25
    g2 = torch.autograd.grad(layer(x).sum() * 0, w)[0]
    assert float(g1.abs().max()) > 0
    torch.testing.assert_close(g2, 0.25 * g1, **TIGHT)


# ---- the dispatchers across ranks -----------------------------------------------------------------
def _dispatch_rank(ep, etp, kind):
    torch.manual_seed(0)
    mesh = ParallelMesh.build(ep=ep, etp=etp)
    cfg = _cfg(["--swiglu", "--expert-model-parallel-size", str(ep),
                "--expert-tensor-parallel-size", str(etp),
                "--tensor-model-parallel-size", "1"], world=mesh.world_size)
    experts = GroupedExperts(cfg, mesh, 1).double()
    whole = GroupedExperts(_cfg(["--swiglu"]), ParallelMesh.single(torch.device("cpu")), 1).double()

    def tokens(r):  # rank r's tokens, routing and output gradient
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(10, 16, dtype=torch.float64, generator=g)
        probs, rmap = topk_routing(torch.randn(10, 8, dtype=torch.float64, generator=g), 2)
        return x, probs, rmap, torch.randn(10, 16, dtype=torch.float64, generator=g)
    x, probs, rmap, up = tokens(mesh.rank)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    out = build_dispatcher(kind, mesh, 8)(x, probs, rmap, experts)
    params = [experts.fc1_weight, experts.gate_weight, experts.fc2_weight]
    grads = torch.autograd.grad((out * up).sum(), [x, probs] + params)
    # the reference: the tokens of this rank's expert-TP x EP group, every expert, one at a time
    run = _expert_loop(whole, None)
    ref_params = [whole.fc1_weight, whole.gate_weight, whole.fc2_weight]
    objective, mine = 0.0, None
    for r in mesh.ranks("etp", "ep"):
        xr, pr, mr, ur = tokens(r)
        xr.requires_grad_(r == mesh.rank)
        pr.requires_grad_(r == mesh.rank)
        o = torch.zeros_like(xr)
        for t in range(10):
            for e in mr[t].nonzero().flatten().tolist():
                o[t] = o[t] + pr[t, e] * run(e, xr[t:t + 1])[0]
        objective = objective + (o * ur).sum()
        if r == mesh.rank:
            mine = (o, xr, pr)
    want = torch.autograd.grad(objective, [mine[1], mine[2]] + ref_params)
    first, n, rank = mesh.coord("ep") * experts.num_local, experts.num_local, mesh.coord("etp")
    f = 12 // etp
    local = [want[2][first:first + n, rank * f:(rank + 1) * f],
             want[3][first:first + n, rank * f:(rank + 1) * f],
             want[4][first:first + n, :, rank * f:(rank + 1) * f]]
    pairs = zip(grads, list(want[:2]) + local)
    errors = [float((out - mine[0]).detach().abs().max())] + [float((a - b).abs().max()) for a, b in pairs]
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("ep,etp", [(4, 1), (2, 2), (2, 1)])
@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_dispatchers_across_ranks_against_a_loop(ep, etp, kind):
    """4 ranks: EP 4, EP 2 x expert TP 2, EP 2 x expert DP 2; output, input, routing-weight and expert
    weight gradients of every rank against a float64 loop over the tokens of its expert group."""
    for errors in run_ranks(_dispatch_rank, 4, ep, etp, kind):
        assert max(errors) <= 1e-11, errors


def _no_tokens_rank(kind):
    """Every token of both ranks goes to experts 0-3 (rank 0's): rank 1's experts get none, yet its
    backward must reach the token collectives (the peers wait in them) and give every weight a gradient."""
    mesh = ParallelMesh.build(ep=2)
    cfg = _cfg(["--swiglu", "--expert-model-parallel-size", "2"], world=2)
    experts = GroupedExperts(cfg, mesh, 1).double()
    g = torch.Generator().manual_seed(7 + mesh.rank)
    x = torch.randn(6, 16, dtype=torch.float64, generator=g, requires_grad=True)
    logits = torch.randn(6, 8, dtype=torch.float64, generator=g)
    logits[:, 4:] -= 100.0
    probs, rmap = topk_routing(logits, 2)
    out = build_dispatcher(kind, mesh, 8)(x, probs, rmap, experts)
    out.sum().backward()
    grads = [p.grad for p in (experts.fc1_weight, experts.gate_weight, experts.fc2_weight)]
    return [g is not None for g in grads], [float(g.abs().sum()) for g in grads], x.grad is not None


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_a_rank_whose_experts_get_no_token(kind):
    first, second = run_ranks(_no_tokens_rank, 2, kind, timeout=60)
    assert first[0] == second[0] == [True] * 3 and first[2] and second[2]
    assert min(first[1]) > 0 and second[1] == [0.0] * 3  # rank 1's experts: zero gradients, but gradients
