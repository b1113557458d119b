"""Gated DeltaNet (models/deltanet.py, models/delta_rule.py) against its sequential float64
recurrence written here, forward and gradients, at lengths that are not multiples of the chunk; and
tensor-parallel (TP 2, with and without sequence parallelism) against one process.

Tolerances: both sides in float64.  The chunked form solves a unit-triangular system per chunk
(entries |beta k.k exp(..)| <= 1 with normalised keys, so it is well conditioned: its error is a few
U64 times L) and sums the same products in another order; outputs are O(1), so errors are ~1e-14 of
the magnitude.  1e-10 of the largest entry still fails any real slip (a dropped chunk state moves
outputs by O(0.1)).
"""
import pytest
import torch
import torch.nn.functional as F

import megazero_models.delta_rule as rule
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from megazero_models.deltanet import DeltaNetShape, GatedDeltaNet
from megazero_models.delta_rule import gated_delta_chunked
from tests.mixer_checks import (assert_cp_equal, assert_kernel_equal, assert_tp_equal, close, cp_grads,
                                hidden_states, mixer_grads, run_kernel, saved_bytes, tp_grads)

SHAPE = DeltaNetShape(hidden_size=16, num_key_heads=2, num_value_heads=4, key_head_dim=4, value_head_dim=3,
                      chunk_size=4, init_std=0.3, out_std=0.3)


def rule_loop(q, k, v, g, beta, state=None):
    """S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t, one position at a time."""
    b, s, h, dk = q.shape
    S = state if state is not None else q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for t in range(s):
        S = torch.exp(g[:, t])[..., None, None] * S
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1), S


def _rule_inputs(s, seed=0, h=3, dk=4, dv=5, b=2):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    k = F.normalize(r(b, s, h, dk), dim=-1)  # the mixer normalises keys (the rule is stable for |k| <= 1)
    return dict(q=r(b, s, h, dk) * 0.5, k=k, v=r(b, s, h, dv), g=-F.softplus(r(b, s, h)),
                beta=torch.sigmoid(r(b, s, h)), state=r(b, h, dk, dv))


def _run_rule(fn, inputs, with_state):
    return run_kernel(fn, inputs, ("q", "k", "v", "g", "beta"), with_state)


@pytest.mark.parametrize("s", [1, 6, 9, 12])
@pytest.mark.parametrize("with_state", [False, True])
def test_rule_matches_recurrence(s, with_state):
    inputs = _rule_inputs(s)
    ref = _run_rule(rule_loop, inputs, with_state)
    chunked = lambda *a: gated_delta_chunked(*a[:5], chunk_size=4, initial_state=a[5])  # noqa: E731
    assert_kernel_equal(_run_rule(chunked, inputs, with_state), ref)


def test_rule_fails_when_chunk_states_are_not_passed(monkeypatch):
    """The comparison above catches a broken inter-chunk recurrence (each chunk starting from zero)."""
    inputs = _rule_inputs(9)
    ref = _run_rule(rule_loop, inputs, False)
    real = rule.chunk_step
    monkeypatch.setattr(rule, "chunk_step", lambda S, *a: real(torch.zeros_like(S), *a))
    got = _run_rule(lambda *a: gated_delta_chunked(*a[:5], chunk_size=4), inputs, False)
    close(got[0][:, :4], ref[0][:, :4])  # the first chunk starts from zero anyway
    with pytest.raises(AssertionError):
        close(got[0], ref[0])


def reference_mixer(m, hidden):
    """The mixer of one process, written out in float64 with :func:`rule_loop` (``hidden [s, b, H]``)."""
    sh = m.shape
    kh, r, dk, dv = sh.num_key_heads, sh.heads_per_key, sh.key_head_dim, sh.value_head_dim
    s, b, _ = hidden.shape
    proj = (hidden @ m.in_proj.weight.T).transpose(0, 1).reshape(b, s, kh, -1)
    edges = torch.tensor([0, dk, dk, r * dv, r * dv, r, r]).cumsum(0).tolist()
    q, k, v, z, bb, a = (proj[..., edges[i]:edges[i + 1]] for i in range(6))
    qkv = torch.cat([q, k, v], -1).reshape(b, s, -1)
    w, width = m.conv1d.weight[:, 0], sh.conv_kernel
    padded = torch.cat([qkv.new_zeros(b, width - 1, qkv.shape[-1]), qkv], 1)
    qkv = F.silu(torch.stack([sum(w[:, j] * padded[:, t + j] for j in range(width)) for t in range(s)], 1))
    qkv = qkv.reshape(b, s, kh, -1)
    q, k, v = qkv[..., :dk], qkv[..., dk:2 * dk], qkv[..., 2 * dk:].reshape(b, s, kh * r, dv)
    q = (q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(r, 2) / dk ** 0.5
    k = (k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(r, 2)
    g = -torch.exp(m.A_log) * F.softplus(a.reshape(b, s, -1) + m.dt_bias)
    o, _ = rule_loop(q, k, v, g, torch.sigmoid(bb.reshape(b, s, -1)))
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + sh.norm_eps) * m.norm.weight
    o = o * F.silu(z.reshape(b, s, kh * r, dv))
    return (o.reshape(b, s, -1) @ m.out_proj.weight.T).transpose(0, 1)


def _hidden(s):
    return hidden_states(s, SHAPE.hidden_size)


@pytest.mark.parametrize("s", [7, 10])
def test_mixer_matches_reference(s):
    m = GatedDeltaNet(SHAPE, ParallelMesh.single(), layer_idx=2).double()
    ref = mixer_grads(m, _hidden(s), fn=reference_mixer)
    got = mixer_grads(m, _hidden(s))
    close(got[0], ref[0])
    close(got[1], ref[1])
    assert set(got[2]) == {"in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
                           "out_proj.weight"}
    for n in ref[2]:
        close(got[2][n], ref[2][n])


def _tp_rank(s, sp):
    mesh = ParallelMesh.build(tp=2)
    m = GatedDeltaNet(SHAPE, mesh, layer_idx=2, sequence_parallel=sp).double()
    return tp_grads(m, _hidden(s), mesh, sp)


SPLIT_DIM = {"in_proj.weight": 0, "conv1d.weight": 0, "A_log": 0, "dt_bias": 0, "out_proj.weight": 1}


@pytest.mark.parametrize("sp", [False, True])
def test_mixer_tensor_parallel(sp):
    s = 10
    ref = mixer_grads(GatedDeltaNet(SHAPE, ParallelMesh.single(), layer_idx=2).double(), _hidden(s))
    out = run_ranks(_tp_rank, 2, s, sp)
    assert_tp_equal(out, ref, sp, SPLIT_DIM)
    # the shared norm scale is replicated: each rank holds the part of its gradient from its heads
    close(out[0][2]["norm.weight"] + out[1][2]["norm.weight"], ref[2]["norm.weight"])


def test_recompute_core_gives_the_same_numbers():
    """Selective recomputation replays the conv, the rule and the norm in backward: the same outputs
    and gradients, bitwise (the same operations on the same data)."""
    plain = mixer_grads(GatedDeltaNet(SHAPE, ParallelMesh.single(), layer_idx=2), _hidden(9).float())
    replay = mixer_grads(GatedDeltaNet(SHAPE, ParallelMesh.single(), layer_idx=2, recompute_core=True),
                         _hidden(9).float())
    for a, b in zip(plain[:2], replay[:2]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for n in plain[2]:
        torch.testing.assert_close(replay[2][n], plain[2][n], rtol=0, atol=0)


def _saved_bytes(rc):
    m = GatedDeltaNet(SHAPE, ParallelMesh.single(), layer_idx=2, recompute_core=rc)
    return saved_bytes(m, _hidden(16).float())


def test_recompute_core_keeps_the_in_projection_output_only():
    plain, replay = _saved_bytes(False), _saved_bytes(True)
    assert replay < plain / 3, (plain, replay)


def test_bf16_parameters_and_activations():
    """bf16 weights and activations (the delta rule runs in fp32 inside): a bf16 output, a backward, and the
    fp32 result within bf16 rounding: about five bf16 roundings of O(max) values on the way (in-projection,
    conv, SiLU, the norm's output, out-projection), each <= 2^-8 of the magnitude; observed
    3.4 x 2^-8; bound 8 x 2^-8 of the largest entry."""
    torch.manual_seed(0)
    m = GatedDeltaNet(DeltaNetShape(hidden_size=64, num_key_heads=2, num_value_heads=4, key_head_dim=16,
                                    value_head_dim=16, chunk_size=16), ParallelMesh.single(), layer_idx=0)
    x = torch.randn(40, 2, 64)
    ref = m(x).detach()
    xb = x.bfloat16().requires_grad_()
    out = m.to(torch.bfloat16)(xb)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and xb.grad is not None and torch.isfinite(xb.grad.float()).all()
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=8 * 2 ** -8 * float(ref.abs().max()))


def _cp_rank(s):
    mesh = ParallelMesh.build(cp=2)
    return cp_grads(GatedDeltaNet(SHAPE, mesh, layer_idx=2).double(), _hidden(s), mesh)


@pytest.mark.parametrize("broken", [None, "conv", "state"])
def test_mixer_context_parallel(broken, monkeypatch):
    """CP 2: each rank's two chunks (of 5 tokens, the rule's chunk 4) continue the conv and the state
    of the chunks before them (the chunk's state map M and read-out R from the rule run on the
    identity); outputs and input gradients equal one process's at this rank's tokens, and the ranks'
    parameter gradients sum to one process's.  With the conv's past inputs or the starting states
    dropped (the forked ranks inherit the patch) the comparison fails."""
    import megazero_models.deltanet as deltanet
    if broken == "conv":
        monkeypatch.setattr(deltanet, "conv_states", lambda tails, mesh: [torch.zeros_like(t) for t in tails])
    if broken == "state":
        monkeypatch.setattr(deltanet, "starting_states", lambda ends, *a: [torch.zeros_like(f) for f in ends])
    s = 20
    ref = mixer_grads(GatedDeltaNet(SHAPE, ParallelMesh.single(), layer_idx=2).double(), _hidden(s))
    assert_cp_equal(run_ranks(_cp_rank, 2, s), ref, broken)
