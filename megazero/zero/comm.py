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
it is waited for, so the optimizer can bound the gradient memory in flight.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero.distributed import reduce_scatter_single


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


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, scale: float = 1.0,
                   accumulate: bool = False) -> Reduction:
    """Start reducing ``inp`` (``N * out.numel()`` elements) over ``group`` into ``out``.

    After ``wait()`` of the result, ``out`` holds ``scale * sum`` of this rank's slice (or has it
    added when ``accumulate``).  The result keeps ``inp`` alive until its collective is over; the
    caller must not change it before.
    """
    n = out.numel()
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
