"""Global gradient norm and clipping over the whole model (TP x PP x DP).

The rule (docs/internals.md): sum the squares of every gradient element this rank *owns*,
counting parameters without ``tensor_model_parallel`` only on TP rank 0 (they are replicated
over TP) and skipping ``tied_copy`` (the last stage's copy of the tied embedding), then sum
over the whole world.  Under ZeRO a rank owns its shard of each bucket, so every element is
counted exactly once and every rank gets the same norm.  Expert parameters (``expert_parallel``)
live on the expert decomposition (etp x ep x edp x pp): each EP rank holds other experts, ZeRO
shards them over expert DP, and one not split over expert TP counts on expert-TP rank 0 only.

The same all-reduce also detects inf/NaN: the excluded elements are summed separately so an
overflow anywhere, even in a gradient that does not count towards the norm, is seen by all.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch
import torch.distributed as dist


def counts_in_norm(param: torch.nn.Parameter, tp_rank: int, etp_rank: int = 0) -> bool:
    """Whether this rank's copy of ``param`` contributes to the global gradient norm (``etp_rank``: this
    rank's expert tensor-parallel coordinate, for expert parameters)."""
    if getattr(param, "tied_copy", False):
        return False
    rank = etp_rank if getattr(param, "expert_parallel", False) else tp_rank
    return bool(getattr(param, "tensor_model_parallel", False)) or rank == 0


SQUARE_CHUNK = 1 << 15  # elements per fp32 dot product in :func:`square_sum`


def square_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of squares of ``tensor`` as a float64 scalar: fp32 dot products over chunks of
    ``SQUARE_CHUNK`` elements, summed in float64.  Relative error ~1e-7 at any size, without
    the float64 copy of the whole tensor (6x slower on CPU); inf/NaN propagate."""
    chunks = tensor.detach().reshape(-1).split(SQUARE_CHUNK)
    if chunks[0].dtype not in (torch.float32, torch.float64):
        chunks = [c.float() for c in chunks]
    parts = [torch.dot(c, c) for c in chunks]
    return torch.stack(parts).double().sum()


def local_square_sums(pieces: Iterable[Tuple[torch.Tensor, bool]]) -> torch.Tensor:
    """``[sum of squares of counted pieces, sum of squares of the others]`` in float64.

    On a CPU each piece is :func:`square_sum` (BLAS dot products: exact to ~1e-7 and fast).  On
    other devices one ``torch._foreach_norm`` per group (a couple of kernels for any number of
    pieces, fp32 accumulation) replaces a dot product per 32K elements, thousands of launches per
    step; the per-piece norms are squared and summed in float64."""
    groups: Tuple[list, list] = ([], [])
    for tensor, counted in pieces:
        if tensor.numel():
            groups[0 if counted else 1].append(tensor.detach().reshape(-1))
    device = next((g[0].device for g in groups if g), torch.device("cpu"))
    if device.type == "cpu" or not hasattr(torch, "_foreach_norm"):
        return torch.stack([sum((square_sum(t) for t in g),
                                torch.zeros((), dtype=torch.float64, device=device))
                            for g in groups])
    return torch.stack([_foreach_square_sum(g, device) for g in groups])


def _foreach_square_sum(tensors: List[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of ``tensors`` (float64 scalar) from one fused norm over the list."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    try:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    except TypeError:  # a torch without the dtype argument: upcast half pieces first
        norms = torch._foreach_norm([t.float() if t.element_size() < 4 else t for t in tensors], 2)
    return torch.stack(norms).double().square().sum()


def global_norm_and_overflow(sums: torch.Tensor, mesh) -> Tuple[float, bool]:
    """All-reduce local square sums over the world; return ``(norm, found_inf)`` (same on every rank)."""
    sums = mesh.collective_tensor(sums)
    if mesh.world_size > 1:
        dist.all_reduce(sums, group=mesh.world_group)
    counted, total = torch.stack([sums[0], sums[0] + sums[1]]).tolist()  # the step's one read of them
    found_inf = not math.isfinite(total)
    return math.sqrt(counted) if math.isfinite(counted) else counted, found_inf


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Megatron's factor ``max_norm / (norm + 1e-6)`` when it is below 1, else 1 (0 disables)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    coef = max_norm / (norm + 1.0e-6)
    return coef if coef < 1.0 else 1.0


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, mesh) -> float:
    """Clip plain ``.grad`` tensors of a model that is *not* under ZeRO (already reduced over DP:
    each DP replica holds the same gradient, so only DP rank 0 contributes).  Returns the norm."""
    params = [p for p in params if p.grad is not None]

    def owner(p):  # the first replica over data parallelism (expert DP for experts)
        return mesh.coord("edp") == 0 if getattr(p, "expert_parallel", False) else mesh.coord("dp", "cp") == 0
    pieces = [(p.grad, counts_in_norm(p, mesh.coord("tp"), mesh.coord("etp")) and owner(p)) for p in params]
    norm, _ = global_norm_and_overflow(local_square_sums(pieces), mesh)
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        for p in params:
            p.grad.mul_(coef)
    return norm
