"""A rank's routed experts and the grouped product that runs them all at once.

:func:`grouped_product` multiplies rows grouped by expert (``x [N, in]``, ``counts[g]`` rows for group
``g``, in group order) by each group's weight (``weight [G, out, in]``): with ``--moe-grouped-gemm``
in one call, never a Python loop over experts, on a GPU with torch's ``grouped_mm``
(``torch.nn.functional.grouped_mm``, half or fp32), elsewhere (and for float64) as one batched
``bmm`` over the groups padded to the longest (on this CPU build ``grouped_mm`` exists but takes
longer than the padded ``bmm``); without it (Megatron-LM's default, its ``SequentialMLP``) one
product per expert on that expert's rows, which on a CPU is the faster of the two (each expert's
product is a large GEMM there, and the padded ``bmm`` computes every expert at the longest group's
rows: ``docs/performance.md``, mixture of experts).

:class:`GroupedExperts` holds a rank's ``E_local = num_experts / EP`` experts, each an MLP split over
the expert-tensor-parallel group like the dense MLP over TP (first product column-parallel, second
row-parallel: its output is a partial sum over expert TP, reduced by the dispatcher). Parameters, the
leading dimension indexing this rank's experts (global expert ``ep_rank * E_local + j``):

- ``fc1_weight [E_local, F / etp, hidden]`` (with SwiGLU also ``gate_weight``, same shape; the output is
  ``fc2(silu(gate x) * fc1 x)``), ``fc2_weight [E_local, hidden, F / etp]``;
  ``F`` = ``--moe-ffn-hidden-size``;
- with biases (no ``--disable-bias-linear``; expert TP 1 only): ``fc1_bias``, ``gate_bias``
  ``[E_local, F]`` and ``fc2_bias [E_local, hidden]``.

Each is marked ``expert_parallel = True`` (reduced and sharded over expert DP, never over DP x CP) and,
for the split ones, ``tensor_model_parallel = True`` with ``partition_dim`` (the split over expert TP).
Expert ``e``'s weights are initialised as the full ``[F, hidden]`` / ``[hidden, F]`` tensor from
``(seed, layer, "mlp.experts.<e>.<name>")`` and this rank keeps its expert-TP slice, so every EP and
expert-TP layout starts from the same model.  Every parameter comes from
:func:`~megazero.tensor_parallel.deferred.new_param`: built on the meta device, none is computed
before the optimizer takes it.
"""
from __future__ import annotations

import math
from functools import partial
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.tensor_parallel.activations import Activation
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import init_full

EXPERT_PARAMS = ("fc1_weight", "gate_weight", "fc2_weight", "fc1_bias", "gate_bias", "fc2_bias")


def _group_rows(counts: Sequence[int], device) -> torch.Tensor:
    """Each row's group index for rows grouped by ``counts`` (host integers: the output size is given,
    so a GPU need not be waited on to learn it)."""
    counts = [int(c) for c in counts]
    return torch.repeat_interleave(torch.arange(len(counts), device=device),
                                   torch.as_tensor(counts, device=device), output_size=sum(counts))


def grouped_product(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int],
                    bias: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """``y[r] = x[r] @ weight[g(r)].T (+ bias[g(r)])`` for rows ``r`` of group ``g(r)`` (rows grouped
    in group order, ``counts`` rows each; a Python list).  ``backend``: ``bmm`` (padded), ``grouped_mm``
    (torch's, where the build has it), ``auto`` (``grouped_mm`` on a GPU, ``bmm`` elsewhere) or
    ``loop`` (one product per group).
    Every weight and ``x`` get a gradient (zero where no row used them) even without rows: a rank's
    backward must reach the token collectives behind ``x``, and ZeRO must see every expert gradient
    in every backward (reductions in the same order on every rank)."""
    counts = [int(c) for c in counts]
    groups = weight.shape[0]
    if len(counts) != groups or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_product: {len(counts)} counts summing to {sum(counts)} for {groups} "
                         f"groups and {x.shape[0]} rows")
    if backend == "auto":
        backend = "grouped_mm" if (x.device.type == "cuda" and hasattr(F, "grouped_mm")
                                   and x.dtype != torch.float64) else "bmm"
    if x.shape[0] == 0:  # no rows: still a product of both, so backward reaches x and every weight
        y = x @ weight[0].t() + weight.sum() * 0  # (the collectives behind x must run on every rank)
    elif backend == "grouped_mm":
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        y = F.grouped_mm(x, weight.transpose(1, 2), offs=offs)
    elif backend == "bmm":
        y = _padded_bmm(x, weight, counts)
    elif backend == "loop":
        y = torch.cat([F.linear(part, weight[g]) for g, part in enumerate(x.split(counts))])
    else:
        raise ValueError(f"grouped_product backend must be auto, bmm, grouped_mm or loop, got {backend!r}")
    if bias is not None:
        y = y + bias.index_select(0, _group_rows(counts, x.device))
    return y


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """One ``bmm`` over the groups, each padded with zero rows to the longest."""
    groups, longest = len(counts), max(counts)
    if all(c == longest for c in counts):  # equal groups: no padding at all
        return torch.bmm(x.view(groups, longest, -1), weight.transpose(1, 2)).reshape(x.shape[0], -1)
    group = _group_rows(counts, x.device)
    starts = torch.tensor([0] + counts[:-1], device=x.device).cumsum(0)
    slot = torch.arange(x.shape[0], device=x.device) - starts[group] + group * longest
    padded = x.new_zeros(groups * longest, x.shape[1]).index_copy(0, slot, x)
    y = torch.bmm(padded.view(groups, longest, -1), weight.transpose(1, 2))
    return y.reshape(groups * longest, -1).index_select(0, slot)


def _stacked_init(full: Sequence[int], seed: int, layer_idx: int, name: str, std: float, experts: range,
                  dim: int, start: int, length: int) -> torch.Tensor:
    """Experts ``experts``' weights ``name`` stacked: each the ``[start, start + length)`` slice along
    ``dim`` of the full ``full``-shaped tensor of key ``(seed, layer, "mlp.experts.<e>.<name>")``."""
    return torch.stack([init_full(full, seed, layer_idx, f"mlp.experts.{e}.{name}", std)
                        .narrow(dim, start, length) for e in experts])


class GroupedExperts(nn.Module):
    """This rank's experts (see the module docstring). ``forward(x [N, hidden], counts)``: rows grouped
    by local expert; returns ``[N, hidden]``, a partial sum over expert TP when it is > 1."""

    def __init__(self, cfg, mesh, layer_idx: int, device=None, backend: Optional[str] = None):
        super().__init__()
        moe, m = cfg.moe, cfg.model
        ep, etp = mesh.size("ep"), mesh.size("etp")
        self.num_local = moe.num_experts // ep
        self.first = mesh.coord("ep") * self.num_local
        # --moe-grouped-gemm: one grouped product; without it, one product per expert (grouped_product)
        backend = backend or ("auto" if moe.moe_grouped_gemm else "loop")
        self.gated, self.backend, self.act = m.gated_mlp, backend, Activation(m)
        ffn, hidden, seed = moe.moe_ffn_hidden_size, m.hidden_size, cfg.training.seed
        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        rank, local_ffn = mesh.coord("etp"), ffn // etp
        device = device if device is not None else mesh.device
        n, first = self.num_local, self.first

        def stack(name, full, std, dim):  # every value the init reads is bound here (it may run later)
            shape = (n, *(local_ffn if d == dim else s for d, s in enumerate(full)))
            init = partial(_stacked_init, full, seed, layer_idx, name, std, range(first, first + n), dim,
                           rank * local_ffn, local_ffn)
            return self._param(new_param(shape, init, device), dim + 1)
        self.fc1_weight = stack("fc1_weight", (ffn, hidden), std, 0)
        self.gate_weight = stack("gate_weight", (ffn, hidden), std, 0) if self.gated else None
        self.fc2_weight = stack("fc2_weight", (hidden, ffn), out_std, 1)
        bias = m.add_bias_linear

        def zeros(width, partition_dim):
            return self._param(new_param((n, width), partial(torch.zeros, n, width, device="cpu"), device),
                               partition_dim)
        self.fc1_bias = zeros(local_ffn, 1) if bias else None
        self.gate_bias = zeros(local_ffn, 1) if bias and self.gated else None
        self.fc2_bias = zeros(hidden, None) if bias else None

    @staticmethod
    def _param(p: nn.Parameter, partition_dim: Optional[int]) -> nn.Parameter:
        p.expert_parallel = True
        if partition_dim is not None:
            p.tensor_model_parallel, p.partition_dim = True, partition_dim
        return p

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        h = grouped_product(x, self.fc1_weight, counts, self.fc1_bias, self.backend)
        if self.gated:
            gate = grouped_product(x, self.gate_weight, counts, self.gate_bias, self.backend)
            h = self.act(h, gate)
        else:
            h = self.act(h)
        return grouped_product(h, self.fc2_weight, counts, self.fc2_bias, self.backend)
