"""Attention over a sequence split across the context-parallel (CP) group.

``comm_type="p2p"`` is ring attention. Each of the N CP ranks holds its queries and its keys/values
(for the load-balanced split: chunks i and 2N-1-i). The K/V blocks travel around the ring, rank r
sending to r+1 and receiving from r-1, so at step t rank r holds the keys of rank r-t. Each step
computes the partial attention of the local queries over that block with the blockwise kernel,
``(out_t, lse_t)``, and merges it into the running result with the log-sum-exp rule
(:func:`megazero.context_parallel.blockwise.merge`). The next block's transfer is posted before
the current block is computed, so communication overlaps compute.

Backward recomputes every block pair from the saved ``q, k, v, out`` and the *global* ``lse``.
dQ stays on its rank. dK/dV of a block are accumulated as they travel with it: at step t rank r adds
its contribution to the gradient of rank r-t's keys, which arrives from r-1 (holding the
contributions of ranks r-t .. r-1) and leaves for r+1; after N steps the buffer reaches its
owner with every rank's contribution. The K/V transfer again overlaps the compute, and each dK/dV
transfer overlaps the next step's compute.

With the load-balanced split every causal step does half of an unmasked block pair's work, on
every rank: the kernel skips tile pairs whose keys all come after their queries (for t > 0, either
the late K/V chunk or the early Q chunk drops out entirely; at t = 0 the diagonal is halved).

``comm_type="a2a"`` is Ulysses (DeepSpeed): see :mod:`megazero.context_parallel.ulysses`.

Attention sinks join once the ring is done: the kernel returns the global ``lse`` with the output, and
:func:`~megazero.context_parallel.blockwise.add_sinks` rescales this rank's rows; its gradient in
``lse`` enters the backward's ``delta`` (``rowsum(dO O) - dlse``), as in the one-rank kernel.

Communication uses only ``torch.distributed`` point-to-point (``batch_isend_irecv``) and
all-to-all on the given group, whatever its backend (gloo on CPUs, NCCL on GPUs).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megazero.context_parallel.blockwise import (Tiles, Visibility, add_sinks, backward_pair,
                                                 blockwise_attention, check_shapes, check_variants,
                                                 compute_dtype, forward_pair, merge)
from megazero.context_parallel.split import cp_positions
from megazero.context_parallel.ulysses import ulysses_attention

CP_COMM_TYPES = ("p2p", "a2a")
_KV_TAG, _DKV_TAG = 0, 1


def check_comm_type(comm_type: str) -> None:
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not implemented; choose one of "
                         f"{', '.join(CP_COMM_TYPES)} (p2p: ring attention, a2a: Ulysses all-to-all)")


class _Ring:
    """This rank's neighbours in the CP group, as global ranks for point-to-point calls."""

    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(self.group)
        self.size, self.rank = len(ranks), dist.get_rank(self.group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        """Post ``send`` to the next rank and ``recv`` from the previous one; returns the requests."""
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])


def _wait(requests) -> None:
    for req in requests:
        req.wait()


def _kv_buffer(kv: torch.Tensor, length: int, dtype=None) -> torch.Tensor:
    shape = (*kv.shape[:3], length, kv.shape[4])
    return torch.empty(shape, dtype=dtype or kv.dtype, device=kv.device)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, q_tiles: Tiles, k_tiles, vis: Visibility, scale: float):
        n, r = ring.size, ring.rank
        cd = compute_dtype(q.dtype)
        qc = q.to(cd)
        kv = torch.stack([k, v])  # one message per step: [2, b, groups, s, d] in the input dtype
        out = lse = None
        for t in range(n):
            if t < n - 1:  # start the next block's transfer before computing on this one
                incoming = _kv_buffer(kv, k_tiles[(r - t - 1) % n].length)
                requests = ring.exchange(kv, incoming, _KV_TAG)
            part = forward_pair(qc, kv[0].to(cd), kv[1].to(cd), q_tiles, k_tiles[(r - t) % n], scale, vis)
            if part is not None:
                out, lse = merge(out, lse, *part)
            if t < n - 1:
                _wait(requests)
                kv = incoming
        if out is None:  # no local query sees any key
            out, lse = qc.new_zeros(q.shape), qc.new_full(q.shape[:3], float("-inf"))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.q_tiles, ctx.k_tiles, ctx.vis, ctx.scale = ring, q_tiles, k_tiles, vis, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring, k_tiles = ctx.ring, ctx.k_tiles
        n, r = ring.size, ring.rank
        cd = compute_dtype(q.dtype)
        qc, dout = q.to(cd), dout.to(cd)
        delta = (dout * out.to(cd)).sum(-1)  # rowsum(dO * O) with the final, global O
        if dlse is not None:  # attention sinks: lse feeds the output too
            delta = delta - dlse.to(cd)
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)
        kv = torch.stack([k, v])
        dkv_requests, dkv_sent, dkv_in = [], None, None
        for t in range(n):
            if t < n - 1:
                incoming = _kv_buffer(kv, k_tiles[(r - t - 1) % n].length)
                requests = ring.exchange(kv, incoming, _KV_TAG)
            owner = (r - t) % n
            mine = _kv_buffer(kv, k_tiles[owner].length, cd).zero_()
            backward_pair(qc, kv[0].to(cd), kv[1].to(cd), dout, lse, delta, ctx.q_tiles, k_tiles[owner],
                          ctx.scale, ctx.vis, dq, mine[0], mine[1])
            if t > 0:  # the contributions of ranks owner .. r-1 to the owner's dK/dV
                _wait(dkv_requests)
                mine += dkv_in
            dkv_in = _kv_buffer(kv, k_tiles[(r - t - 1) % n].length, cd)
            dkv_requests, dkv_sent = ring.exchange(mine, dkv_in, _DKV_TAG), mine  # sent kept alive
            if t < n - 1:
                _wait(requests)
                kv = incoming
        _wait(dkv_requests)  # after N steps our own blocks' gradients, summed over the ring
        del dkv_sent
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None, None, None


def _rank_positions(positions, cp_size: int, local_len: int):
    if positions is None:
        return [cp_positions(cp_size * local_len, cp_size, r) for r in range(cp_size)]
    positions = list(positions)
    if len(positions) != cp_size:
        raise ValueError(f"positions holds {len(positions)} tensors for a context-parallel group of "
                         f"{cp_size} ranks; give every CP rank's global positions, in group rank order")
    return positions


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   positions: Optional[Sequence[torch.Tensor]] = None, *, comm_type: str = "p2p",
                   causal: bool = True, scale: Optional[float] = None, block_size: int = 256,
                   window: Optional[int] = None, softcap: Optional[float] = None,
                   documents: Optional[Sequence[torch.Tensor]] = None, chunk: Optional[int] = None,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (or full) self-attention of a sequence split over the CP ``group``; returns this rank's
    output ``[b, heads, s_local, d]``, differentiable in ``q, k, v``.

    ``q [b, heads, s_local, d]``, ``k, v [b, groups, s_local, d]`` are this rank's tokens.
    ``positions``: every CP rank's global token positions (1-D int tensors, in group rank order; rank
    r's gives the order of its local tokens). ``None`` means the load-balanced split of
    ``cp_size * s_local`` tokens (:func:`megazero.context_parallel.cp_positions`); ranks may hold
    different numbers of tokens when given explicitly. ``comm_type``: ``"p2p"`` (ring) or ``"a2a"``
    (Ulysses). ``scale`` defaults to ``1 / sqrt(d)``; ``block_size`` is the kernel's tile length;
    ``window`` (keys before its own a query sees) and ``softcap`` as in
    :func:`~megazero.context_parallel.blockwise.blockwise_attention`: a K/V block wholly outside every
    local query's window is skipped (it still travels the ring).  ``documents``: every CP rank's
    document ids ``[b, s_r]`` (packed documents, in group rank order, on the device): a query sees keys
    of its own document only.  ``chunk`` (chunked attention, by global position) and ``sinks [heads]``
    (this rank's heads' sink logits) as in the one-rank kernel."""
    check_comm_type(comm_type)
    check_shapes(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"self-attention holds as many keys as queries on each rank; got {q.shape[2]} "
                         f"queries and {k.shape[2]} keys")
    cp_size = dist.get_world_size(group)
    cp_rank = dist.get_rank(group)
    positions = _rank_positions(positions, cp_size, q.shape[2])
    if positions[cp_rank].numel() != q.shape[2]:
        raise ValueError(f"CP rank {cp_rank} holds {q.shape[2]} tokens but {positions[cp_rank].numel()} "
                         f"positions")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    docs = list(documents) if documents is not None else [None] * cp_size
    if len(docs) != cp_size:
        raise ValueError(f"documents holds {len(docs)} tensors for a context-parallel group of {cp_size} "
                         "ranks")
    check_variants(causal, window, chunk)
    if cp_size == 1:
        return blockwise_attention(q, k, v, positions[0], positions[0], causal, scale, block_size, window,
                                   softcap, docs[0], docs[0], chunk, sinks)[0]
    vis = Visibility(causal, window, softcap, chunk)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, group, positions, vis, scale, block_size, documents, sinks)
    k_tiles = [Tiles(p, block_size, q.device, d) for p, d in zip(positions, docs)]
    out, lse = _RingAttention.apply(q, k, v, _Ring(group), k_tiles[cp_rank], k_tiles, vis, scale)
    return out if sinks is None else add_sinks(out, lse, sinks)[0]
