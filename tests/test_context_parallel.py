"""Context parallelism against the one-process oracle, in float64.

- The load-balanced split (2N chunks, rank i holds chunks i and 2N-1-i): round trip, positions, and
  the refusal of a length it cannot split.
- The blockwise kernel against plain masked softmax attention on output, log-sum-exp and every
  input gradient: causal and not, GQA, odd lengths with offset and non-contiguous positions, query
  rows that see no key, tiles smaller than and not dividing the length, sliding windows and
  soft-capped scores; and its saved activations are O(s); tiles (and ring blocks) outside every
  query's window are skipped.
- Ring attention (p2p) and Ulysses (a2a) on CP 2 and CP 4 gloo ranks against plain attention over
  the whole sequence in one process: the output and dq/dk/dv, gathered back to sequence order.

Tolerance: both sides in float64 summing at most 64 terms, so they differ by ~64 * 2^-53 ~ 1e-14 of
the magnitude; 1e-10 of the magnitude leaves a wide margin and still catches any 1e-6 error. Checked
once by hand that the tests fail when the math is broken: merging ring blocks without the
log-sum-exp weights (``out + part_out``), a mask of ``>=`` instead of ``>``, a backward without the
``- dlse`` term or with the local instead of the global lse, the dK/dV buffer not travelling the last
hop to its owner, and skipping the diagonal tile pairs each make several of these tests fail; so do a
window that hides one key too many (``>=``) and a soft-cap backward without its ``1 - tanh^2``.
"""
import pytest
import torch
import torch.distributed as dist

from megazero.context_parallel import (blockwise_attention, check_comm_type, cp_chunk_bounds, cp_positions,
                                       gather_from_cp, ring_attention, split_for_cp)
from megazero.process.local_ranks import run_ranks

B, D = 2, 8


def reference(q, k, v, q_pos, k_pos, causal=True, scale=None, window=None, softcap=None):
    """Plain attention: the whole masked score matrix, softmax, matmul (rows seeing no key -> 0, -inf);
    scores soft-capped at ``softcap``, keys more than ``window`` positions back hidden."""
    scale = D ** -0.5 if scale is None else scale
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    if window is not None:
        s = s.masked_fill(q_pos[:, None] - k_pos[None, :] > window, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = m.masked_fill(m == float("-inf"), 0.0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    out = (e @ v) / total
    lse = torch.where(seen, m + torch.log(total), torch.full_like(total, float("-inf"))).squeeze(-1)
    return out, lse


def make(seed, heads, groups, sq, sk):
    g = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(B, heads, sq, D, generator=g, dtype=torch.float64)
    k = 1.5 * torch.randn(B, groups, sk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, groups, sk, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, heads, sq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, heads, sq, generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def close(got, ref):
    """Equal to float64 precision: within 1e-10 of the reference's magnitude."""
    finite = ref[torch.isfinite(ref)]
    magnitude = float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(got, ref, rtol=0.0, atol=1e-10 * max(magnitude, 1.0))


def grads(fn, q, k, v, dout, dlse):
    """``fn``'s (out, lse) and the gradients of ``<out, dout> + <lse, dlse>`` (lse of rows that see
    some key) with respect to q, k, v."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out * dout).sum() + (lse.masked_fill(torch.isinf(lse), 0.0) * dlse).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


# name: (heads, groups, queries, keys, query offset or positions, causal, block, scale[, window, softcap])
KERNEL_CASES = {
    "window 5, tiles of 7": (4, 2, 37, 37, 0, True, 7, None, 5, None),
    "window 0 (itself only), GQA after 16 keys": (4, 2, 37, 53, 16, True, 8, None, 0, None),
    "window 9 of load-balanced chunks": (4, 2, 24, 24, "split", True, 5, None, 9, None),
    "soft-capped scores, own scale": (4, 2, 37, 37, 0, True, 8, 0.7, None, 1.5),
    "soft-capped scores in a window, one key head": (4, 1, 37, 53, 16, True, 6, None, 11, 2.0),
    "causal, tiles not dividing the length": (4, 4, 37, 37, 0, True, 8, None),
    "causal GQA, 37 queries after 53 keys": (4, 2, 37, 53, 16, True, 7, None),
    "full GQA, one key head, 37 x 53": (4, 1, 37, 53, 0, False, 16, None),
    "causal, one tile longer than the sequence, own scale": (4, 2, 16, 16, 0, True, 256, 0.3),
    "causal, load-balanced chunks, rows that see nothing": (4, 2, 24, 24, "split", True, 5, None),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_blockwise_kernel_matches_plain_attention(name):
    heads, groups, sq, sk, offset, causal, block, scale, *extra = KERNEL_CASES[name]
    window, softcap = extra or (None, None)
    q, k, v, dout, dlse = make(len(name), heads, groups, sq, sk)
    if offset == "split":  # rank 0's queries of a CP 2 split of 48 against rank 1's keys
        q_pos, k_pos = cp_positions(48, 2, 0), cp_positions(48, 2, 1)
    else:
        q_pos, k_pos = torch.arange(sq) + offset, torch.arange(sk)
    got = grads(lambda a, b, c: blockwise_attention(a, b, c, q_pos, k_pos, causal, scale, block, window,
                                                    softcap), q, k, v, dout, dlse)
    ref = grads(lambda a, b, c: reference(a, b, c, q_pos, k_pos, causal, scale, window, softcap),
                q, k, v, dout, dlse)
    for g, r in zip(got, ref):
        close(g, r)
    if offset == "split" and window is None:  # queries 0..11 come before every key: nothing to attend to
        assert torch.isinf(got[1][:, :, :12]).all() and (got[0][:, :, :12] == 0).all()
        assert torch.isfinite(got[1][:, :, 12:]).all()


def test_blockwise_kernel_saves_linear_memory():
    """What autograd keeps is q, k, v, out and lse: O(s) elements, where plain attention keeps O(s^2)."""
    s = 256
    q, k, v, _, _ = make(0, 4, 2, s, s)
    q.requires_grad_()

    def saved(fn):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sizes
    mine = saved(lambda: blockwise_attention(q, k, v, block_size=32))
    plain = saved(lambda: reference(q, k, v, torch.arange(s), torch.arange(s)))
    linear = 2 * q.numel() + 2 * k.numel() + B * 4 * s  # q, out, k, v, lse
    assert sum(mine) == linear
    assert max(plain) >= B * 4 * s * s  # the oracle keeps the score matrix


def test_split_round_trip_and_positions():
    x = torch.arange(2 * 48 * 3).view(2, 48, 3)
    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 3, 4):
        parts = [split_for_cp(x, 1, cp, r) for r in range(cp)]
        assert torch.equal(gather_from_cp(parts, 1), x)
        for r in range(cp):  # the positions index the rank's tokens
            assert torch.equal(parts[r], x[:, cp_positions(48, cp, r)])
        assert sorted(torch.cat([cp_positions(48, cp, r) for r in range(cp)]).tolist()) == list(range(48))
    assert cp_chunk_bounds(37, 2, allow_uneven=True) == [(0, 10), (10, 19), (19, 28), (28, 37)]
    parts = [split_for_cp(x[:, :37], 1, 2, r, allow_uneven=True) for r in range(2)]
    assert [p.shape[1] for p in parts] == [19, 18]
    assert torch.equal(gather_from_cp(parts, 1, allow_uneven=True), x[:, :37])


def test_refusals_name_the_flags():
    refusal = r"--seq-length 20 .*--context-parallel-size 4.*divisible by 8.*16 or 24"
    with pytest.raises(ValueError, match=refusal):
        split_for_cp(torch.zeros(1, 20), 1, 4, 0)
    with pytest.raises(ValueError, match=r"--seq-length 5 .*nearest valid lengths are 8"):
        cp_positions(5, 4, 1)
    with pytest.raises(ValueError, match=r"--cp-comm-type 'allgather' is not implemented.*p2p, a2a"):
        check_comm_type("allgather")
    q = torch.zeros(1, 2, 4, D)
    with pytest.raises(ValueError, match="--cp-comm-type"):  # refused before any communication
        ring_attention(q, q, q, comm_type="ring")


# name: (cp, comm, heads, groups, seq, causal, uneven, block, strided subgroups)
RING_CASES = {
    "cp2 p2p causal, tiles not dividing the chunks": (2, "p2p", 4, 4, 32, True, False, 3, False),
    "cp2 p2p causal GQA": (2, "p2p", 4, 2, 32, True, False, 256, False),
    "cp2 p2p full attention": (2, "p2p", 4, 2, 32, False, False, 5, False),
    "cp2 p2p causal GQA, 37 tokens (ranks hold 19 and 18)": (2, "p2p", 4, 2, 37, True, True, 4, False),
    "cp2 a2a causal GQA": (2, "a2a", 4, 2, 32, True, False, 6, False),
    "cp2 a2a causal, one key head, 37 tokens": (2, "a2a", 4, 1, 37, True, True, 8, False),
    "cp4 p2p causal": (4, "p2p", 4, 4, 64, True, False, 5, False),
    "cp4 p2p causal GQA": (4, "p2p", 4, 2, 64, True, False, 256, False),
    "cp4 p2p causal, one key head, 45 tokens": (4, "p2p", 4, 1, 45, True, True, 4, False),
    "cp4 a2a causal": (4, "a2a", 4, 4, 64, True, False, 7, False),
    "cp4 a2a causal GQA, 45 tokens": (4, "a2a", 4, 2, 45, True, True, 8, False),
    "cp2 p2p on groups [0, 2] and [1, 3]": (2, "p2p", 4, 2, 32, True, False, 4, True),
    # sliding windows and soft-capped scores: (..., {window, softcap})
    "cp2 p2p window 5, GQA": (2, "p2p", 4, 2, 32, True, False, 3, False, dict(window=5)),
    "cp4 p2p window 3 and soft-cap, 45 tokens": (4, "p2p", 4, 2, 45, True, True, 4, False,
                                                 dict(window=3, softcap=1.5)),
    "cp2 a2a window 6 and soft-cap": (2, "a2a", 4, 2, 32, True, False, 5, False, dict(window=6, softcap=2.0)),
}


def _positions(seq, cp, uneven):
    return [cp_positions(seq, cp, r, allow_uneven=uneven) for r in range(cp)]


def _rank_cases(world):
    """On each rank: every case of this world size; returns {name: (out, dq, dk, dv)} of its tokens."""
    rank = dist.get_rank()
    # CP groups of non-neighbouring global ranks, [0, 2] and [1, 3]: every rank creates both
    strided = [dist.new_group(list(range(p, world, 2))) for p in range(2)] if world == 4 else ()
    results = {}
    for name, (cp, comm, heads, groups, seq, causal, uneven, block, sub, *extra) in RING_CASES.items():
        if (4 if sub else cp) != world:  # the strided groups need 4 ranks
            continue
        group = strided[rank % 2] if sub else None
        cp_rank = dist.get_rank(group)
        q, k, v, dout, _ = make(len(name), heads, groups, seq, seq)
        q, k, v = (split_for_cp(t, 2, cp, cp_rank, uneven).requires_grad_() for t in (q, k, v))
        out = ring_attention(q, k, v, group, _positions(seq, cp, uneven), comm_type=comm, causal=causal,
                             block_size=block, **(extra[0] if extra else {}))
        out.backward(split_for_cp(dout, 2, cp, cp_rank, uneven))
        results[name] = (out.detach(), q.grad, k.grad, v.grad)
    return results


@pytest.fixture(scope="module")
def ring_results():
    return {world: run_ranks(_rank_cases, world, world) for world in (2, 4)}


@pytest.mark.parametrize("name", list(RING_CASES))
def test_context_parallel_attention_matches_one_process(ring_results, name):
    cp, _, heads, groups, seq, causal, uneven, _, sub, *extra = RING_CASES[name]
    q, k, v, dout, _ = make(len(name), heads, groups, seq, seq)
    pos = torch.arange(seq)
    kw = extra[0] if extra else {}
    ref = grads(lambda a, b, c: reference(a, b, c, pos, pos, causal, **kw), q, k, v, dout, torch.zeros(1))
    ref = (ref[0], *ref[2:])
    members = [[0, 2], [1, 3]] if sub else [list(range(cp))]  # global ranks of each CP group, CP order
    for ranks in members:
        per_rank = [ring_results[4 if sub else cp][r][name] for r in ranks]
        for i, r in enumerate(ref):  # out, dq, dk, dv
            close(gather_from_cp([p[i] for p in per_rank], 2, allow_uneven=uneven), r)


def test_tiles_and_ring_blocks_outside_the_window_are_skipped():
    """A window of 7 over 64 positions in tiles of 8: the diagonal tile pairs and the ones just before
    them (15), not the 36 of causal attention.  Under CP 4 (chunks of 8, rank 0 holding positions
    0-7 and 56-63), rank 2's block (16-23, 40-47) lies wholly outside rank 0's windows of 4: the
    ring computes nothing for it, while causal attention needs it."""
    from megazero.context_parallel.blockwise import Tiles, Visibility, tile_pairs
    whole = Tiles(torch.arange(64), 8, "cpu")
    assert tile_pairs(whole, whole, Visibility()) == 36
    assert tile_pairs(whole, whole, Visibility(window=7)) == 15
    ranks = [Tiles(cp_positions(64, 4, r), 8, "cpu") for r in range(4)]
    assert tile_pairs(ranks[0], ranks[2], Visibility(window=4)) == 0
    assert tile_pairs(ranks[0], ranks[2], Visibility()) > 0
    assert tile_pairs(ranks[0], ranks[1], Visibility(window=4)) > 0  # 52-55 are within 4 of 56-59
