"""Collectives over the tensor-parallel group as autograd functions (Megatron's f and g operators).

Each function is the identity when ``mesh.size("tp") == 1``. "tp" functions split or gather the
last dimension (hidden / vocab); "sp" functions split or gather dimension 0, the sequence, for
sequence parallelism (activations ``[seq / tp, batch, hidden]``).

| function               | forward                  | backward                 |
|------------------------|--------------------------|--------------------------|
| copy_to_tp             | identity                 | all-reduce               |
| reduce_from_tp         | all-reduce               | identity                 |
| scatter_to_tp          | keep my last-dim slice   | all-gather last dim      |
| gather_from_tp         | all-gather last dim      | keep my last-dim slice   |
| scatter_to_sp          | keep my seq slice        | all-gather seq           |
| gather_from_sp         | all-gather seq           | reduce-scatter seq       |
| reduce_scatter_to_sp   | reduce-scatter seq       | all-gather seq           |
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.process.distributed import all_gather_single, reduce_scatter_single


def _all_reduce(x: torch.Tensor, mesh) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=mesh.group("tp"))
    return out


def _gather_dim0(x: torch.Tensor, mesh) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((mesh.size("tp") * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=mesh.group("tp"))
    return out


def _reduce_scatter_dim0(x: torch.Tensor, mesh) -> torch.Tensor:
    x = x.contiguous()
    if x.shape[0] % mesh.size("tp"):
        raise ValueError(f"dimension 0 ({x.shape[0]}) is not divisible by the tensor-parallel size "
                         f"{mesh.size('tp')}")
    out = torch.empty((x.shape[0] // mesh.size("tp"), *x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, x, group=mesh.group("tp"))
    return out


def _split(x: torch.Tensor, dim: int, mesh) -> torch.Tensor:
    if x.shape[dim] % mesh.size("tp"):
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel "
                         f"size {mesh.size('tp')}")
    return x.chunk(mesh.size("tp"), dim=dim)[mesh.coord("tp")].contiguous()


def _gather_last(x: torch.Tensor, mesh) -> torch.Tensor:
    gathered = _gather_dim0(x.movedim(-1, 0), mesh)  # [tp * n, ...]: rank r's slice at rows r*n .. (r+1)*n
    return gathered.movedim(0, -1).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.mesh), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        return _all_reduce(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _split(x, -1, mesh)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.mesh), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _gather_last(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.mesh), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _split(x, 0, mesh)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim0(g, ctx.mesh), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _gather_dim0(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_dim0(g, ctx.mesh), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _reduce_scatter_dim0(x, mesh)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim0(g, ctx.mesh), None


def _apply(fn, x, mesh):
    if mesh is None or mesh.size("tp") == 1:
        return x
    return fn.apply(x, mesh)


def copy_to_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over the TP group (input of a column-parallel layer)."""
    return _apply(_CopyToTP, x, mesh)


def reduce_from_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """All-reduce (sum) over the TP group; identity backward (output of a row-parallel layer)."""
    return _apply(_ReduceFromTP, x, mesh)


def scatter_to_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; all-gather the gradient."""
    return _apply(_ScatterToTP, x, mesh)


def gather_from_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """All-gather the last dimension over the TP group (rank order); split the gradient."""
    return _apply(_GatherFromTP, x, mesh)


def scatter_to_sp(x: torch.Tensor, mesh) -> torch.Tensor:
    """Keep this rank's slice of dimension 0 (the sequence); all-gather the gradient."""
    return _apply(_ScatterToSP, x, mesh)


def gather_from_sp(x: torch.Tensor, mesh) -> torch.Tensor:
    """All-gather dimension 0 (the sequence); reduce-scatter the gradient (input of a column-parallel
    layer under sequence parallelism: every rank's partial gradient of the full sequence is summed)."""
    return _apply(_GatherFromSP, x, mesh)


def reduce_scatter_to_sp(x: torch.Tensor, mesh) -> torch.Tensor:
    """Sum over the TP group and keep this rank's slice of dimension 0; all-gather the gradient
    (output of a row-parallel layer under sequence parallelism)."""
    return _apply(_ReduceScatterToSP, x, mesh)
