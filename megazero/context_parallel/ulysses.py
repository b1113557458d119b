"""Ulysses context parallelism (DeepSpeed): trade the sequence split for a head split.

Each of the N CP ranks holds all heads of its own tokens. An all-to-all sends head slice j of the
local tokens to rank j, so afterwards rank j holds heads ``j*H/N .. (j+1)*H/N - 1`` of *every* token
(rank 0's tokens first, then rank 1's, ...). Attention then runs locally over the whole sequence
for those heads, the causal mask coming from the tokens' global positions (so the order in which
the load-balanced split left them does not matter), and a second all-to-all returns each rank's
tokens with all heads. Backward is the same two all-to-alls in reverse around the kernel's own
backward.

Two all-to-alls of q, k, v and one of the output move ``4 x`` the local activations, independent of
N, against the ring's ``2 (N - 1)`` K/V blocks; but every rank needs ``H / N`` whole heads, so the
number of heads on the rank must be divisible by N. Key/value heads (GQA groups) that do not divide
by N are repeated up to the query heads first (a copy of K and V).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from megazero.context_parallel.blockwise import blockwise_attention


def _seq_to_heads(x: torch.Tensor, group, lengths: List[int]) -> torch.Tensor:
    """``[b, H, s_local, d]`` -> ``[b, H / N, sum(lengths), d]``: my head slice of every rank's tokens."""
    n, rank = len(lengths), dist.get_rank(group)
    b, heads, s, d = x.shape
    hn = heads // n
    send = x.reshape(b, n, hn, s, d).transpose(0, 1).contiguous().view(-1)  # slice j first for rank j
    recv = x.new_empty(b * hn * sum(lengths) * d)
    dist.all_to_all_single(recv, send, [b * hn * length * d for length in lengths],
                           [b * hn * lengths[rank] * d] * n, group=group)
    pieces = recv.split([b * hn * length * d for length in lengths])
    return torch.cat([p.view(b, hn, length, d) for p, length in zip(pieces, lengths)], dim=2)


def _heads_to_seq(x: torch.Tensor, group, lengths: List[int]) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: ``[b, H / N, S, d]`` -> ``[b, H, s_local, d]``."""
    n, rank = len(lengths), dist.get_rank(group)
    b, hn, _, d = x.shape
    s = lengths[rank]
    send = torch.cat([p.reshape(-1) for p in x.split(lengths, dim=2)])  # rank j's tokens to rank j
    recv = x.new_empty(n * b * hn * s * d)
    dist.all_to_all_single(recv, send, [b * hn * s * d] * n, [b * hn * length * d for length in lengths],
                           group=group)
    return recv.view(n, b, hn, s, d).transpose(0, 1).reshape(b, n * hn, s, d)


class _AllToAll(torch.autograd.Function):
    """Sequence-sharded <-> head-sharded; the backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, lengths, to_heads: bool):
        ctx.group, ctx.lengths, ctx.to_heads = group, lengths, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, lengths)

    @staticmethod
    def backward(ctx, grad):
        undo = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return undo(grad.contiguous(), ctx.group, ctx.lengths), None, None, None


def ulysses_attention(q, k, v, group, positions, vis, scale: float, block_size: int,
                      documents=None, sinks=None) -> torch.Tensor:
    """Ulysses attention; arguments as :func:`megazero.context_parallel.ring_attention` (resolved; ``vis``
    the :class:`~megazero.context_parallel.blockwise.Visibility`).  ``sinks [heads]``: the local heads'
    sink logits; each rank applies those of the heads it holds between the two all-to-alls."""
    n = dist.get_world_size(group)
    heads, groups = q.shape[1], k.shape[1]
    if heads % n:
        raise ValueError(f"--cp-comm-type a2a splits the {heads} attention heads on this rank "
                         f"(--num-attention-heads / --tensor-model-parallel-size) over "
                         f"--context-parallel-size {n}, which must divide them; use --cp-comm-type p2p")
    if groups % n:  # GQA groups that cannot be split: give every query head its own K/V head
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    lengths = [int(p.numel()) for p in positions]
    everyone = torch.cat([p.reshape(-1).to("cpu", torch.long) for p in positions])
    qh, kh, vh = (_AllToAll.apply(t, group, lengths, True) for t in (q, k, v))
    docs = torch.cat(list(documents), dim=1) if documents is not None else None  # in the same order
    if sinks is not None:  # the heads this rank attends for: slice j of the local heads
        hn = heads // n
        sinks = sinks[dist.get_rank(group) * hn:][:hn]
    out, _ = blockwise_attention(qh, kh, vh, everyone, everyone, vis.causal, scale, block_size, vis.window,
                                 vis.softcap, docs, docs, vis.chunk, sinks)
    return _AllToAll.apply(out, group, lengths, False)
