"""Token dispatchers: take each token to its experts and their outputs back (Megatron-core's two).

Both take ``x [T, hidden]`` (this rank's tokens), the router's ``probs [T, E]`` and ``routing_map [T, E]``
and the rank's :class:`~megazero.moe.experts.GroupedExperts`, and return ``sum_e probs[t, e] *
expert_e(x[t])`` for each token, the sum in the probs' dtype (fp32; float64 in the exact tests).
The token-expert pairs are taken expert by expert, tokens in order, so every layout adds a token's
expert outputs in the same order.
With ``probs_on_input`` (``--moe-apply-probs-on-input``, top-1 only) the weight scales the expert's input
instead, ``sum_e expert_e(probs[t, e] * x[t])`` (Llama 4; the product in the probs' dtype, then the
input's, as Megatron-core): :func:`_weigh_input`, in both dispatchers before the tokens travel.

- ``alltoall``: pairs sorted by expert; an all-to-all over the EP group sends each expert its rows
  (counts exchanged first: dropless, uneven); with expert TP > 1 the received rows are gathered over
  the expert-TP group (its ranks hold different tokens and different slices of the same experts),
  regrouped by local expert for one grouped product, and the partial outputs reduce-scattered back;
  then the reverse all-to-all.
- ``allgather``: every rank of the expert-TP x EP group gathers all of the group's tokens and routing,
  computes its local experts' share and the shares are reduce-scattered back (simple, more traffic).

Token counts stay on the device: counted from the routing map, exchanged by collectives of device
tensors (NCCL takes no other) and brought to the host once per layer and forward, by one
non-blocking copy (:class:`~megazero.moe.comm.HostCopy`) waited on where the split sizes are first
needed (before the tokens' all-to-all, as Megatron-core).  The token-expert pairs and the regrouping
order are found on the device from the counts (cumulative sums, no ``nonzero``), so nothing else in
the dispatcher's forward or backward waits for the device.
"""
from __future__ import annotations

import torch

from megazero.moe.comm import (HostCopy, all_to_all_rows, exchange_counts, gather_counts, gather_rows,
                               reduce_scatter_rows)


def _pair_order(routing_map: torch.Tensor) -> torch.Tensor:
    """The entries of the expert-major map (``expert * T + token``), routed pairs first (by expert,
    then token), found without reading the map on the host: each set entry goes to its rank among
    them (a cumulative sum), the others after them."""
    flat = routing_map.t().reshape(-1)
    taken = torch.cumsum(flat, 0)
    place = torch.where(flat, taken - 1, taken[-1:] + torch.cumsum(~flat, 0) - 1)
    return torch.empty_like(place).scatter_(0, place, torch.arange(flat.numel(), device=flat.device))


def _pairs(order: torch.Tensor, probs: torch.Tensor, total: int):
    """``(expert, token, weight)`` of the ``total`` routed pairs (``routing_map.sum()``) of
    :func:`_pair_order`'s ``order``, sorted by expert, then token."""
    order = order[:total]
    expert, token = order // probs.shape[0], order % probs.shape[0]
    return expert, token, probs[token, expert]


def _weigh_input(rows: torch.Tensor, weight: torch.Tensor):
    """``--moe-apply-probs-on-input``: the pairs' input rows scaled by their weights (in the weights'
    dtype, back to the rows'), and the combine's weights: 1 for every pair with a weight, 0 for the
    weightless ones (the pad-to-capacity fillers, which add nothing however their input is scaled)."""
    scaled = (rows.to(weight.dtype) * weight.unsqueeze(1)).to(rows.dtype)
    return scaled, (weight != 0).to(weight.dtype)


def _combine(y: torch.Tensor, token: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``out[t] = sum over pairs (t, e) of weight * y`` in the weights' dtype."""
    out = weight.new_zeros((rows, y.shape[1]))
    return out.index_add(0, token, y.to(weight.dtype) * weight.unsqueeze(1))


def _block_order(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """Row permutation that regroups the ``rows`` rows laid out in blocks ``counts [a, b, E_local]``
    (a-major) by their last index first (expert-major, then a, then b), built on ``counts``' device."""
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    by_expert = torch.arange(flat.numel(), device=flat.device).view(counts.shape).permute(2, 0, 1).reshape(-1)
    lengths, firsts = flat[by_expert], starts[by_expert]
    offsets = torch.cumsum(lengths, 0) - lengths  # each block's first row in the new order
    within = torch.arange(rows, device=flat.device) - torch.repeat_interleave(offsets, lengths,
                                                                              output_size=rows)
    return torch.repeat_interleave(firsts, lengths, output_size=rows) + within


class AllToAllDispatcher:
    """See the module docstring."""

    def __init__(self, mesh, num_experts: int, probs_on_input: bool = False):
        self.mesh, self.num_experts, self.probs_on_input = mesh, num_experts, probs_on_input
        self.num_local = num_experts // mesh.size("ep")

    def __call__(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                 experts) -> torch.Tensor:
        mesh, ep, etp = self.mesh, self.mesh.size("ep"), self.mesh.size("etp")
        # [EP destination, E_local], on the device the mesh's collectives take (the routing's own)
        counts = mesh.collective_tensor(routing_map.sum(0).view(ep, self.num_local))
        recv = exchange_counts(counts, mesh.group("ep")) if ep > 1 else counts  # [EP source, E_local]
        # rows arrive in blocks (expert-TP peer, EP source, local expert)
        layout = gather_counts(recv, mesh.group("etp")) if etp > 1 else recv.unsqueeze(0)
        pending = HostCopy(torch.cat([counts.reshape(-1), layout.reshape(-1)]))
        order = _pair_order(routing_map)  # queued while the counts travel
        read = pending.wait().tolist()  # the layer's one host read, where the split sizes are first needed
        send = [sum(read[r * self.num_local:(r + 1) * self.num_local]) for r in range(ep)]
        peers = [[read[self.num_experts + (p * ep + r) * self.num_local:][:self.num_local] for r in range(ep)]
                 for p in range(etp)]  # layout on the host
        mine = [sum(row) for row in peers[mesh.coord("etp")]]  # rows from each EP source
        sizes = [sum(sum(row) for row in peer) for peer in peers]
        per_expert = [sum(peer[r][e] for peer in peers for r in range(ep)) for e in range(self.num_local)]
        expert, token, weight = _pairs(order, probs, sum(send))
        rows = x.index_select(0, token)
        if self.probs_on_input:
            rows, weight = _weigh_input(rows, weight)
        rows = all_to_all_rows(rows, mesh.group("ep"), mine, send)
        rows = gather_rows(rows, mesh.group("etp"), sizes, mesh.coord("etp"))
        order = _block_order(layout, sum(sizes))
        y = experts(rows.index_select(0, order), per_expert)
        y = torch.empty_like(y).index_copy(0, order, y)  # back to (peer, source, expert) order
        y = reduce_scatter_rows(y, mesh.group("etp"), sizes, mesh.coord("etp"))
        y = all_to_all_rows(y, mesh.group("ep"), send, mine)
        return _combine(y, token, weight, x.shape[0])


class AllGatherDispatcher:
    """See the module docstring."""

    def __init__(self, mesh, num_experts: int, probs_on_input: bool = False):
        self.mesh, self.num_experts, self.probs_on_input = mesh, num_experts, probs_on_input
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
        pending = HostCopy(ms.sum(0))
        order = _pair_order(ms)  # queued while the counts travel
        counts = pending.wait().tolist()  # the layer's one host read
        expert, token, weight = _pairs(order, ps, sum(counts))
        inputs = xs.index_select(0, token)
        if self.probs_on_input:
            inputs, weight = _weigh_input(inputs, weight)
        y = experts(inputs, counts)
        out = _combine(y, token, weight, xs.shape[0])
        return reduce_scatter_rows(out, group, rows, rank)


def build_dispatcher(kind: str, mesh, num_experts: int, probs_on_input: bool = False):
    """The dispatcher ``--moe-token-dispatcher-type`` names (``probs_on_input``:
    ``--moe-apply-probs-on-input``)."""
    if kind == "alltoall":
        return AllToAllDispatcher(mesh, num_experts, probs_on_input)
    if kind == "allgather":
        return AllGatherDispatcher(mesh, num_experts, probs_on_input)
    raise ValueError(f"--moe-token-dispatcher-type must be alltoall or allgather, got {kind!r}")
