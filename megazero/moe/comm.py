"""The collectives that move tokens between expert ranks, as autograd functions (one per collective,
as :mod:`megazero.tensor_parallel.mappings`), on rows of ``[rows, hidden]`` tensors whose counts differ
from rank to rank.  Every one is the identity on a group of one rank.

| function             | forward                                   | backward                   |
|----------------------|-------------------------------------------|----------------------------|
| ``all_to_all_rows``  | rows ``send[r]`` to rank r, ``recv[r]`` from it | the reverse all-to-all |
| ``gather_rows``      | every rank's rows, in group order          | reduce-scatter of the rows |
| ``reduce_scatter_rows`` | sum over the group, keep this rank's rows | gather of the rows        |

Row counts are Python lists known on every rank: the dispatcher exchanges its device counts with
:func:`exchange_counts` / :func:`gather_counts` (collectives of device tensors, as NCCL requires) and
reads them on the host once, through a :class:`HostCopy`.  Uneven gathers and reduce-scatters pad
every rank's rows to the longest.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from megazero.process.distributed import all_gather_single, reduce_scatter_single


class HostCopy:
    """A device tensor's copy to the host, started at once and read with :meth:`wait`: on CUDA a
    non-blocking copy into pinned memory and an event recorded after it, so the device runs on and the
    host waits only where it needs the values; on the CPU the tensor itself (nothing to copy).  The
    one way the MoE layers bring values to the host (``tests/test_strict_device.py`` marks what
    :meth:`wait` returns as host memory)."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tensor.device))
        else:  # the CPU (no copy), or a device without pinned copies here (a blocking one)
            self.host = tensor.to("cpu")

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy is done."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """``send [n, ...]`` int64 (row i for rank i) -> what every rank sent this one, ``[n, ...]``, on
    ``send``'s device."""
    if _size(group) == 1:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``counts`` (same shape everywhere), stacked in group order: ``[n, *counts.shape]``."""
    n = _size(group)
    if n == 1:
        return counts.unsqueeze(0).clone()
    out = torch.empty((n * counts.numel(),), dtype=counts.dtype, device=counts.device)
    all_gather_single(out, counts.reshape(-1).contiguous(), group=group)
    return out.view(n, *counts.shape)


def _all_to_all(x: torch.Tensor, group, out_rows: List[int], in_rows: List[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_rows),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    return out


def _gather(x: torch.Tensor, group, rows: List[int]) -> torch.Tensor:
    longest, n = max(rows), len(rows)
    padded = x if x.shape[0] == longest else \
        torch.cat([x, x.new_zeros((longest - x.shape[0],) + tuple(x.shape[1:]))])
    buf = x.new_empty((n * longest,) + tuple(x.shape[1:]))
    all_gather_single(buf, padded.contiguous(), group=group)
    return torch.cat([buf[i * longest:i * longest + r] for i, r in enumerate(rows)])


def _reduce_scatter(x: torch.Tensor, group, rows: List[int], rank: int) -> torch.Tensor:
    longest = max(rows)
    starts = [0]
    for r in rows[:-1]:
        starts.append(starts[-1] + r)
    buf = x.new_zeros((len(rows) * longest,) + tuple(x.shape[1:]))
    for i, (s, r) in enumerate(zip(starts, rows)):
        buf[i * longest:i * longest + r] = x[s:s + r]
    out = x.new_empty((longest,) + tuple(x.shape[1:]))
    reduce_scatter_single(out, buf, group=group)
    return out[:rows[rank]]


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_rows, in_rows):
        ctx.group, ctx.out_rows, ctx.in_rows = group, out_rows, in_rows
        return _all_to_all(x, group, out_rows, in_rows)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, ctx.in_rows, ctx.out_rows), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rows, rank):
        ctx.group, ctx.rows, ctx.rank = group, rows, rank
        return _gather(x, group, rows)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, ctx.rows, ctx.rank), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rows, rank):
        ctx.group, ctx.rows = group, rows
        return _reduce_scatter(x, group, rows, rank)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, ctx.rows), None, None, None


def all_to_all_rows(x: torch.Tensor, group, out_rows: Sequence[int], in_rows: Sequence[int]) -> torch.Tensor:
    """Send ``in_rows[r]`` consecutive rows of ``x`` to rank r; receive ``out_rows[r]`` from it."""
    if _size(group) == 1:
        return x
    return _AllToAllRows.apply(x, group, [int(r) for r in out_rows], [int(r) for r in in_rows])


def gather_rows(x: torch.Tensor, group, rows: Sequence[int], rank: int) -> torch.Tensor:
    """Every rank's rows (``rows[r]`` of rank r), concatenated in group order."""
    if _size(group) == 1:
        return x
    return _GatherRows.apply(x, group, [int(r) for r in rows], rank)


def reduce_scatter_rows(x: torch.Tensor, group, rows: Sequence[int], rank: int) -> torch.Tensor:
    """``x`` (rank r's part: ``rows[r]`` rows, in group order) summed over the group; this rank's part."""
    if _size(group) == 1:
        return x
    return _ReduceScatterRows.apply(x, group, [int(r) for r in rows], rank)
