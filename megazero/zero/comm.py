"""The reductions ZeRO runs on every bucket, as fast as the backend allows, as objects in flight.

gloo (CPU) implements ``reduce_scatter_single`` as a clone of the input, a full all-reduce and a
copy of this rank's slice, so it costs as much as an all-reduce (1.1-1.4x, measured on 2 and 4
ranks; see ``scripts/bench_zero.py``).  An ``all_to_all_single`` moves only ``(N-1)/N`` of the
bucket per rank, like a ring reduce-scatter; summing the ``N`` received slices locally then gives
this rank's reduced slice at about half gloo's reduce-scatter time, at the price of a full-bucket
receive buffer while it runs.  Other backends (NCCL) use their native reduce-scatter, and so do
bf16/fp16 gradients: summed in another order than gloo's all-reduce, their rounding would make
ZeRO-1/2/3 drift visibly from stage 0 under Adam.

On NCCL a mean over the whole group is ``ReduceOp.AVG`` (:func:`averages_natively`); gloo has no
average for these collectives, so there the sum is scaled after it.

Every launch returns a :class:`Reduction` that says how many bytes of temporaries it holds until
it is waited for, so the optimizer can bound the gradient memory in flight.  A reduction the caller
waits for at once (``blocking``: the tied embedding's parts, embedding-sized) runs on gloo as a
series of all-to-alls of column pieces through one receive buffer of :data:`PIECE_BYTES`.  The tied
embedding's two parts need not exist whole at all: :func:`reduce_row_pieces` reduces the head's
part as its product computes it, a piece of rows at a time, and :func:`reduce_rows` the lookup's
sparse part as every rank's rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.process.distributed import all_gather_single, reduce_scatter_single


class Reduction:
    """One asynchronous collective and its post-processing.

    ``nbytes``: bytes of temporaries this object allocated and holds until :meth:`wait` (a receive
    buffer, a partial result), not counting the caller's input.  ``finish_bytes``: bytes allocated
    only while :meth:`wait` post-processes.  :meth:`wait` waits, drops the input (before
    post-processing, so the two never coexist with the finish temporaries) and then every
    temporary.
    """

    def __init__(self, work, finish: Optional[Callable[[], None]] = None,
                 held_input: Optional[torch.Tensor] = None, nbytes: int = 0, finish_bytes: int = 0):
        self.work, self.finish, self.held_input = work, finish, held_input
        self.nbytes, self.finish_bytes = nbytes, finish_bytes

    def done(self) -> bool:
        """Whether the collective has completed (never blocks)."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work, self.held_input = None, None
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()


def averages_natively(group, size: int) -> bool:
    """Whether a mean over ``size`` ranks of ``group`` can be the collective's own ``ReduceOp.AVG``:
    NCCL has it for all-reduce and reduce-scatter (one kernel, no pass of its own to divide), gloo
    does not (there the sum is divided afterwards, as before), and the mean must be over the group
    itself (expert buckets average over more ranks than their group)."""
    return (hasattr(dist.ReduceOp, "AVG") and dist.get_backend(group) == "nccl"
            and size == dist.get_world_size(group))


def all_reduce_mean(buf: torch.Tensor, group, size: int) -> Reduction:
    """Start summing ``buf`` in place over ``group`` and dividing by ``size`` (the ranks the mean is
    over, which for expert buckets are more than the group's); no temporaries."""
    if averages_natively(group, size):
        return Reduction(dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=group, async_op=True))
    work = dist.all_reduce(buf, group=group, async_op=True)
    return Reduction(work, lambda: buf.mul_(1.0 / size))


PIECE_BYTES = 32 << 20  #: receive buffer of a blocking reduction on gloo (bytes)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, scale: float = 1.0,
                   accumulate: bool = False, blocking: bool = False) -> Reduction:
    """Start reducing ``inp`` (``N * out.numel()`` elements) over ``group`` into ``out``.

    After ``wait()`` of the result, ``out`` holds ``scale * sum`` of this rank's slice (or has it
    added when ``accumulate``).  The result keeps ``inp`` alive until its collective is over; the
    caller must not change it before.  ``blocking`` (gloo, fp32/fp64): done on return, exchanged
    in pieces through one receive buffer of at most :data:`PIECE_BYTES` instead of a full-bucket one.
    """
    n = out.numel()
    if inp.dtype in (torch.float32, torch.float64) and dist.get_backend(group) == "gloo" and blocking:
        _reduce_scatter_pieces(out, inp.view(-1, n), group, scale, accumulate)
        return Reduction(None)
    if inp.dtype in (torch.float32, torch.float64) and dist.get_backend(group) == "gloo":
        recv = torch.empty_like(inp)
        work = dist.all_to_all_single(recv, inp, group=group, async_op=True)
        slices = recv.view(-1, n)

        def finish():
            if accumulate:
                out.add_(slices.sum(0), alpha=scale)
            else:
                torch.sum(slices, 0, out=out)
                if scale != 1.0:
                    out.mul_(scale)
        return Reduction(work, finish, inp, recv.nbytes, out.nbytes if accumulate else 0)
    tmp = torch.empty_like(out) if accumulate else out
    size = dist.get_world_size(group)
    if not accumulate and scale == 1.0 / size and averages_natively(group, size):
        return Reduction(reduce_scatter_single(out, inp, group=group, async_op=True, op=dist.ReduceOp.AVG),
                         None, inp)
    work = reduce_scatter_single(tmp, inp, group=group, async_op=True)

    def finish_native():
        if accumulate:
            out.add_(tmp, alpha=scale)
        elif scale != 1.0:
            out.mul_(scale)
    return Reduction(work, finish_native, inp, tmp.nbytes if accumulate else 0)


def _reduce_scatter_pieces(out: torch.Tensor, rows: torch.Tensor, group, scale: float,
                           accumulate: bool) -> None:
    """:func:`reduce_scatter` of ``rows`` (``[N, n]``: row ``r`` goes to rank ``r``) in pieces of
    columns, each an all-to-all of contiguous row slices into one reused receive buffer."""
    N, n = rows.shape
    m = max(1, min(n, PIECE_BYTES // (N * rows.element_size())))
    recv = torch.empty(N, m, dtype=rows.dtype, device=rows.device)
    for a in range(0, n, m):
        k = min(m, n - a)
        parts = [recv[r, :k] for r in range(N)]
        dist.all_to_all(parts, [rows[r, a:a + k] for r in range(N)], group=group)
        got = recv[:, :k]
        if accumulate:
            out[a:a + k].add_(got.sum(0), alpha=scale)
        else:
            torch.sum(got, 0, out=out[a:a + k])
            if scale != 1.0:
                out[a:a + k].mul_(scale)


def reduce_rows(out: torch.Tensor, lo: int, indices: torch.Tensor, rows: torch.Tensor, group,
                scale: float = 1.0, accumulate: bool = False) -> None:
    """Reduce a gradient given as rows over ``group`` into ``out``: ``rows [m, h]`` at row ``indices
    [m]`` of a flattened ``[*, h]`` gradient (a sparse embedding gradient: the rows of the tokens
    looked up), ``out`` this rank's slice ``[lo, lo + out.numel())`` of it.  Every rank's rows are
    gathered (``m`` may differ between ranks) and the elements that fall in the slice are added,
    times ``scale`` (over what ``out`` holds when ``accumulate``, over zeros otherwise): the dense
    gradient, as large as the embedding, never exists."""
    h = rows.shape[1]
    if group is not None and dist.get_world_size(group) > 1:
        size = dist.get_world_size(group)
        counts = torch.empty(size, dtype=torch.int64, device=rows.device)
        all_gather_single(counts, torch.tensor([indices.numel()], device=rows.device), group=group)
        top = int(counts.max())
        idx = torch.zeros(top, dtype=torch.int64, device=rows.device)
        val = rows.new_zeros(top, h)  # padding: zero rows at row 0
        idx[:indices.numel()], val[:indices.numel()] = indices, rows
        indices, rows = idx.new_empty(size * top), val.new_empty(size * top, h)
        all_gather_single(indices, idx, group=group)
        all_gather_single(rows, val, group=group)
    elements = indices[:, None] * h + torch.arange(h, device=rows.device)
    inside = (elements >= lo) & (elements < lo + out.numel())
    if not accumulate:
        out.zero_()
    out.index_add_(0, elements[inside] - lo, rows[inside], alpha=scale)


def reduce_row_pieces(out: torch.Tensor, lo: int, rows: int, width: int, fill: Callable, group,
                      scale: float = 1.0, accumulate: bool = False) -> None:
    """Reduce a ``[rows, width]`` gradient computed a piece of rows at a time over ``group`` into
    ``out``, this rank's slice ``[lo, lo + out.numel())`` of it flattened (and padded: elements past
    ``rows * width`` are zeros).  ``fill(a, e, buf)`` writes rows ``[a, e)`` of this rank's part into
    ``buf`` (``[e - a, width]``); each piece is summed onto the ranks owning its elements
    (``dist.reduce``) and added there times ``scale`` (over what ``out`` holds when ``accumulate``):
    one buffer of :data:`PIECE_BYTES`, never one of the gradient's size."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    n = out.numel()
    if not accumulate:
        out[max(rows * width - lo, 0):].zero_()  # the padding
    per = max(1, min(rows, PIECE_BYTES // (width * out.element_size())))
    buf = torch.empty(per, width, dtype=out.dtype, device=out.device)
    for a in range(0, rows, per):
        e = min(rows, a + per)
        piece = buf[:e - a]
        fill(a, e, piece)
        flat, start = piece.reshape(-1), a * width
        for owner in range(start // n, min(size, -(-(e * width) // n))):  # the ranks whose slice it meets
            s0, s1 = max(start, owner * n), min(e * width, (owner + 1) * n)
            seg = flat[s0 - start:s1 - start]
            dist.reduce(seg, dst=dist.get_global_rank(group, owner), group=group)
            if owner == me:
                dst = out[s0 - lo:s1 - lo]
                if accumulate:
                    dst.add_(seg, alpha=scale)
                else:
                    torch.mul(seg, scale, out=dst)
