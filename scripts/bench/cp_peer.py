"""The context-parallel peer of ``bench_peers.py``: a plain ring attention from torch primitives.

``torch.distributed.tensor.experimental.context_parallel`` does not run on CPUs (torch 2.13 has no
sharding strategy for ``aten._scaled_dot_product_flash_attention_for_cpu``), so the peer is the ring a
PyTorch user would write without it: the same load-balanced split as megazero (2N chunks, rank i
holds chunks i and 2N-1-i), and per ring step the whole ``[s/N, s/N]`` score block of the local
queries against the visiting keys (``matmul``, a mask from the global positions, softmax with its
log-sum-exp),
merged with the log-sum-exp rule; K/V move one rank along the ring with the differentiable
``all_to_all_single_autograd`` of ``torch.distributed._functional_collectives``, and autograd keeps
every step's probabilities for backward (O(s^2 / N) per rank, where megazero's kernel keeps O(s / N)).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def balanced_positions(seq: int, n: int, rank: int) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens: chunks ``rank`` and ``2n-1-rank`` of ``2n``."""
    c = seq // (2 * n)
    late = 2 * n - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def _shift(t: torch.Tensor, group, rank: int, n: int) -> torch.Tensor:
    """``t`` of rank ``rank - 1`` (differentiable): everything goes to ``rank + 1``."""
    sizes_out = [t.shape[0] if j == (rank + 1) % n else 0 for j in range(n)]
    sizes_in = [t.shape[0] if j == (rank - 1) % n else 0 for j in range(n)]
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(t.contiguous(), sizes_in, sizes_out, group))


def _block(q, k, v, hidden):
    """Masked softmax attention of one block: ``(out, lse)``; rows that see nothing: ``0, -inf``."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(hidden, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    seen = total > 0
    out = (e @ v) / torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, lse


def plain_ring_attention(q, k, v, group, positions: List[torch.Tensor]) -> torch.Tensor:
    """Causal attention of ``q, k, v [b, heads, s/N, d]`` over the CP ``group`` (every rank's global
    positions in ``positions``)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = torch.stack([k, v])
    out = lse = None
    for t in range(n):
        src = (rank - t) % n
        hidden = positions[src][None, :] > positions[rank][:, None]
        o, s = _block(q, kv[0], kv[1], hidden)
        if out is None:
            out, lse = o, s
        else:
            new = torch.logaddexp(lse, s)
            safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
            out = out * torch.exp(lse - safe) + o * torch.exp(s - safe)
            lse = new
        if t < n - 1:
            kv = _shift(kv.flatten(0, 1), group, rank, n).view_as(kv)
    return out
