"""Token dispatchers: take each token to its experts and their outputs back (Megatron-core's two).

Both take ``x [T, hidden]`` (this rank's tokens), the router's ``probs [T, E]`` and ``routing_map [T, E]``
and the rank's :class:`~megazero.moe.experts.GroupedExperts`, and return ``sum_e probs[t, e] *
expert_e(x[t])`` for each token, the sum in the probs' dtype (fp32; float64 in the exact tests).
The token-expert pairs are taken expert by expert, tokens in order, so every layout adds a token's
expert outputs in the same order.

- ``alltoall``: pairs sorted by expert; an all-to-all over the EP group sends each expert its rows
  (counts exchanged first: dropless, uneven); with expert TP > 1 the received rows are gathered over
  the expert-TP group (its ranks hold different tokens and different slices of the same experts),
  regrouped by local expert for one grouped product, and the partial outputs reduce-scattered back;
  then the reverse all-to-all.
- ``allgather``: every rank of the expert-TP x EP group gathers all of the group's tokens and routing,
  computes its local experts' share and the shares are reduce-scattered back (simple, more traffic).
"""
from __future__ import annotations

import torch

from megazero.moe.comm import (all_to_all_rows, exchange_counts, gather_counts, gather_rows,
                               reduce_scatter_rows)


def _pairs(routing_map: torch.Tensor, probs: torch.Tensor):
    """``(expert, token, weight)`` of every routed pair, sorted by expert, then token."""
    expert, token = routing_map.t().nonzero(as_tuple=True)
    return expert, token, probs.t()[expert, token]


def _combine(y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``out[t] = sum over pairs (t, e) of weight * y`` in the weights' dtype."""
    out = weight.new_zeros((rows, y.shape[1]))
    return out.index_add(0, token, y.to(weight.dtype) * weight.unsqueeze(1))


def _block_order(counts: torch.Tensor, device) -> torch.Tensor:
    """Row permutation that regroups rows laid out in blocks ``counts [a, b, E_local]`` (a-major) by
    their last index first (expert-major, then a, then b)."""
    flat = counts.reshape(-1).to(torch.int64)
    starts = torch.cumsum(flat, 0) - flat
    by_expert = torch.arange(flat.numel()).view(counts.shape).permute(2, 0, 1).reshape(-1)
    lengths, firsts = flat[by_expert], starts[by_expert]
    offsets = torch.cumsum(lengths, 0) - lengths  # each block's first row in the new order
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
    return (torch.repeat_interleave(firsts, lengths) + within).to(device)


class AllToAllDispatcher:
    """See the module docstring."""

    def __init__(self, mesh, num_experts: int):
        self.mesh, self.num_experts = mesh, num_experts
        self.num_local = num_experts // mesh.size("ep")

    def __call__(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts) -> torch.Tensor:
        mesh, ep, etp = self.mesh, self.mesh.size("ep"), self.mesh.size("etp")
        expert, token, weight = _pairs(routing_map, probs)
        counts = torch.bincount(expert, minlength=self.num_experts).view(ep, self.num_local).cpu()
        recv = exchange_counts(counts, mesh.group("ep")) if ep > 1 else counts  # [ep src, E_local]
        rows = x.index_select(0, token)
        rows = all_to_all_rows(rows, mesh.group("ep"), recv.sum(1).tolist(), counts.sum(1).tolist())
        # rows arrive in blocks (expert-TP peer, EP source, local expert)
        layout = gather_counts(recv, mesh.group("etp")) if etp > 1 else recv.unsqueeze(0)
        sizes = layout.sum((1, 2)).tolist()
        rows = gather_rows(rows, mesh.group("etp"), sizes, mesh.coord("etp"))
        order = _block_order(layout, x.device)
        y = experts(rows.index_select(0, order), layout.sum((0, 1)).tolist())
        y = torch.empty_like(y).index_copy(0, order, y)  # back to (peer, source, expert) order
        y = reduce_scatter_rows(y, mesh.group("etp"), sizes, mesh.coord("etp"))
        y = all_to_all_rows(y, mesh.group("ep"), counts.sum(1).tolist(), recv.sum(1).tolist())
        return _combine(y, token, weight, x.shape[0])


class AllGatherDispatcher:
    """See the module docstring."""

    def __init__(self, mesh, num_experts: int):
        self.mesh, self.num_experts = mesh, num_experts
        self.num_local = num_experts // mesh.size("ep")
        self.first = mesh.coord("ep") * self.num_local

    def __call__(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts) -> torch.Tensor:
        mesh = self.mesh
        group, n, rank = mesh.group("etp", "ep"), mesh.size("etp", "ep"), mesh.coord("etp", "ep")
        rows = [x.shape[0]] * n
        xs = gather_rows(x, group, rows, rank)
        local = slice(self.first, self.first + self.num_local)  # every rank's routing, this rank's experts
        ps = gather_rows(probs, group, rows, rank)[:, local]
        ms = routing_map
        if n > 1:
            ms = gather_counts(ms.to(torch.int64), group).reshape(xs.shape[0], -1) > 0
        ms = ms[:, local]
        expert, token, weight = _pairs(ms, ps)
        counts = torch.bincount(expert, minlength=self.num_local).tolist()
        y = experts(xs.index_select(0, token), counts)
        out = _combine(y, token, weight, xs.shape[0])
        return reduce_scatter_rows(out, group, rows, rank)


def build_dispatcher(kind: str, mesh, num_experts: int):
    """The dispatcher ``--moe-token-dispatcher-type`` names."""
    if kind == "alltoall":
        return AllToAllDispatcher(mesh, num_experts)
    if kind == "allgather":
        return AllGatherDispatcher(mesh, num_experts)
    raise ValueError(f"--moe-token-dispatcher-type must be alltoall or allgather, got {kind!r}")
