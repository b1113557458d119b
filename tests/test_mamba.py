"""The Mamba-2 mixer (models/mamba.py, models/ssd.py) against a sequential float64 recurrence written
here, forward and gradients, at lengths that are not multiples of the chunk; and tensor-parallel
(TP 2, with and without sequence parallelism) against one process.

Tolerances: both sides run in float64.  The chunked form sums the same products in another order
(and forms decays as exp of sums instead of products of exps): each output is a sum of at most
s * n * p <= 16 * 4 * 4 terms of size O(1) through <= 16 decays, so its error is a few hundred
U64 of the magnitude (~1e-13); 1e-10 of the largest entry still fails any real slip (a dropped
chunk state moves outputs by O(0.1)).
"""
import pytest
import torch
import torch.nn.functional as F

import megazero_models.ssd as ssd
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from megazero_models.mamba import MambaMixer, MambaShape
from megazero_models.ssd import ssd_chunked
from tests.mixer_checks import (assert_cp_equal, assert_kernel_equal, assert_tp_equal, close, cp_grads,
                                hidden_states, mixer_grads, run_kernel, saved_bytes, tp_grads)

SHAPE = MambaShape(hidden_size=16, num_heads=4, head_dim=4, state_dim=3, num_groups=2, chunk_size=4,
                   conv_bias=True, bias=False, init_std=0.3, out_std=0.3)


def scan_loop(x, dt, A, B, C, state=None):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t, one position at a time."""
    b, s, h, p = x.shape
    r = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(r, 2), C.repeat_interleave(r, 2)
    S = state if state is not None else x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(s):
        S = torch.exp(dt[:, t] * A)[..., None, None] * S \
            + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
    return torch.stack(ys, 1), S


def _scan_inputs(s, seed=0, h=4, g=2, p=3, n=5, b=2):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(x=r(b, s, h, p), dt=F.softplus(r(b, s, h)), A=-torch.exp(r(h) * 0.5), B=r(b, s, g, n),
                C=r(b, s, g, n), state=r(b, h, p, n))


def _run_scan(fn, inputs, with_state):
    return run_kernel(fn, inputs, ("x", "dt", "A", "B", "C"), with_state)


@pytest.mark.parametrize("s", [1, 5, 9, 16])
@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_matches_recurrence(s, with_state):
    inputs = _scan_inputs(s)
    ref = _run_scan(scan_loop, inputs, with_state)
    got = _run_scan(lambda *a: ssd_chunked(*a[:5], chunk_size=4, initial_state=a[5]), inputs, with_state)
    assert_kernel_equal(got, ref)


def test_ssd_fails_when_chunk_states_are_not_passed(monkeypatch):
    """The comparison above catches a broken inter-chunk recurrence (each chunk starting from zero)."""
    inputs = _scan_inputs(9)
    ref = _run_scan(scan_loop, inputs, False)
    real = ssd.pass_states
    monkeypatch.setattr(ssd, "pass_states", lambda cs, d, init: (torch.zeros_like(cs), real(cs, d, init)[1]))
    got = _run_scan(lambda *a: ssd_chunked(*a[:5], chunk_size=4), inputs, False)
    close(got[1], ref[1])  # the final state does not depend on the starts
    with pytest.raises(AssertionError):
        close(got[0], ref[0])


def reference_mixer(m, hidden):
    """The mixer of one process, written out in float64 with :func:`scan_loop` (``hidden [s, b, H]``)."""
    sh = m.shape
    g, r, p, n = sh.num_groups, sh.heads_per_group, sh.head_dim, sh.state_dim
    s, b, _ = hidden.shape
    proj = (hidden @ m.in_proj.weight.T).transpose(0, 1).reshape(b, s, g, 2 * r * p + 2 * n + r)
    z, xbc, dt = proj[..., :r * p], proj[..., r * p:2 * r * p + 2 * n], proj[..., 2 * r * p + 2 * n:]
    xbc = xbc.reshape(b, s, -1)
    w, k = m.conv1d.weight[:, 0], sh.conv_kernel
    padded = torch.cat([xbc.new_zeros(b, k - 1, xbc.shape[-1]), xbc], 1)
    conv = torch.stack([sum(w[:, j] * padded[:, t + j] for j in range(k)) for t in range(s)], 1)
    xbc = F.silu(conv + m.conv1d.bias).reshape(b, s, g, -1)
    x, B, C = xbc[..., :r * p].reshape(b, s, g * r, p), xbc[..., r * p:r * p + n], xbc[..., r * p + n:]
    dt = F.softplus(dt.reshape(b, s, g * r) + m.dt_bias)
    y, _ = scan_loop(x, dt, -torch.exp(m.A_log), B, C)
    y = (y + x * m.D[:, None]).reshape(b, s, g, r * p) * F.silu(z)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + sh.norm_eps)
    y = y.reshape(b, s, -1) * m.norm.weight
    return (y @ m.out_proj.weight.T).transpose(0, 1)


def _hidden(s):
    return hidden_states(s, SHAPE.hidden_size)


@pytest.mark.parametrize("s", [7, 10])
def test_mixer_matches_reference(s):
    m = MambaMixer(SHAPE, ParallelMesh.single(), layer_idx=1).double()
    hidden = _hidden(s)
    ref = mixer_grads(m, hidden, fn=reference_mixer)
    got = mixer_grads(m, hidden)
    close(got[0], ref[0])
    close(got[1], ref[1])
    assert set(got[2]) == {"in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                           "norm.weight", "out_proj.weight"}
    for k in ref[2]:
        close(got[2][k], ref[2][k])


def _tp_rank(s, sp):
    mesh = ParallelMesh.build(tp=2)
    return tp_grads(MambaMixer(SHAPE, mesh, layer_idx=1, sequence_parallel=sp).double(), _hidden(s), mesh, sp)


# TP splits along: in_proj by output rows (groups), conv and per-head tensors by channel / head,
# the norm scale by channel, out_proj by input columns
SPLIT_DIM = {"in_proj.weight": 0, "conv1d.weight": 0, "conv1d.bias": 0, "A_log": 0, "D": 0, "dt_bias": 0,
             "norm.weight": 0, "out_proj.weight": 1}


@pytest.mark.parametrize("sp", [False, True])
def test_mixer_tensor_parallel(sp):
    s = 10
    one = MambaMixer(SHAPE, ParallelMesh.single(), layer_idx=1).double()
    assert_tp_equal(run_ranks(_tp_rank, 2, s, sp), mixer_grads(one, _hidden(s)), sp, SPLIT_DIM)


def test_recompute_core_gives_the_same_numbers():
    """Selective recomputation replays the conv, scan and norm in backward: the same outputs and
    gradients, bitwise (the same operations on the same data)."""
    plain = mixer_grads(MambaMixer(SHAPE, ParallelMesh.single(), layer_idx=1), _hidden(9).float())
    replay = mixer_grads(MambaMixer(SHAPE, ParallelMesh.single(), layer_idx=1, recompute_core=True),
                         _hidden(9).float())
    for a, b in zip(plain[:2], replay[:2]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for k in plain[2]:
        torch.testing.assert_close(replay[2][k], plain[2][k], rtol=0, atol=0)


def _saved_bytes(rc):
    m = MambaMixer(SHAPE, ParallelMesh.single(), layer_idx=1, recompute_core=rc)
    return saved_bytes(m, _hidden(16).float())


def test_recompute_core_keeps_the_in_projection_output_only():
    plain, replay = _saved_bytes(False), _saved_bytes(True)
    assert replay < plain / 3, (plain, replay)


def test_bf16_parameters_and_activations():
    """bf16 weights and activations (the scan runs in fp32 inside): a bf16 output, a backward, and the
    fp32 result within bf16 rounding: about five bf16 roundings of O(max) values on the way (in-projection,
    conv, SiLU, the norm's output, out-projection), each <= 2^-8 of the magnitude; observed
    1.6 x 2^-8; bound 8 x 2^-8 of the largest entry."""
    torch.manual_seed(0)
    shape = MambaShape(hidden_size=64, num_heads=8, head_dim=16, state_dim=16, num_groups=2, chunk_size=16)
    m = MambaMixer(shape, ParallelMesh.single(), layer_idx=0)
    x = torch.randn(40, 2, 64)
    ref = m(x).detach()
    xb = x.bfloat16().requires_grad_()
    out = m.to(torch.bfloat16)(xb)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and xb.grad is not None and torch.isfinite(xb.grad.float()).all()
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=8 * 2 ** -8 * float(ref.abs().max()))


def _cp_rank(s):
    mesh = ParallelMesh.build(cp=2)
    return cp_grads(MambaMixer(SHAPE, mesh, layer_idx=1).double(), _hidden(s), mesh)


@pytest.mark.parametrize("broken", [None, "conv", "state"])
def test_mixer_context_parallel(broken, monkeypatch):
    """CP 2: each rank's two chunks (of 5 tokens, the scan's chunk 4) continue the conv and the state
    of the chunks before them; outputs and input gradients equal one process's at this rank's
    tokens, and the ranks' parameter gradients sum to one process's.  With the conv's past inputs or
    the starting states dropped (the forked ranks inherit the patch) the comparison fails."""
    import megazero_models.mamba as mamba
    if broken == "conv":
        monkeypatch.setattr(mamba, "conv_states", lambda tails, mesh: [torch.zeros_like(t) for t in tails])
    if broken == "state":
        monkeypatch.setattr(mamba, "starting_states", lambda ends, *a: [torch.zeros_like(f) for f in ends])
    s = 20
    ref = mixer_grads(MambaMixer(SHAPE, ParallelMesh.single(), layer_idx=1).double(), _hidden(s))
    assert_cp_equal(run_ranks(_cp_rank, 2, s), ref, broken)
