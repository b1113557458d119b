"""The reduce-scatter ZeRO-1/2/3 run on every bucket, as fast as the backend allows.

gloo (CPU) implements ``reduce_scatter_single`` as a clone of the input, a full all-reduce and a
copy of this rank's slice, so it costs as much as an all-reduce (1.1-1.4x, measured on 2 and 4
ranks; see ``scripts/bench_zero.py``).  An ``all_to_all_single`` moves only ``(N-1)/N`` of the
bucket per rank, like a ring reduce-scatter; summing the ``N`` received slices locally then gives
this rank's reduced slice at about half gloo's reduce-scatter time.  Other backends (NCCL) use
their native reduce-scatter, and so do bf16/fp16 gradients: summed in another order than gloo's
all-reduce, their rounding would make ZeRO-1/2/3 drift visibly from stage 0 under Adam.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.distributed as dist


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, scale: float = 1.0,
                   accumulate: bool = False) -> Tuple[object, Callable[[], None]]:
    """Start reducing ``inp`` (``N * out.numel()`` elements) over ``group`` into ``out``.

    Returns ``(work, finish)``: after ``work.wait()``, ``finish()`` writes ``scale * sum`` of this
    rank's slice into ``out`` (or adds it when ``accumulate``).  ``inp`` must stay alive and
    unchanged until then.
    """
    n = out.numel()
    if inp.dtype in (torch.float32, torch.float64) and dist.get_backend(group) == "gloo":
        recv = torch.empty_like(inp)
        work = dist.all_to_all_single(recv, inp, group=group, async_op=True)

        def finish(_keep=inp):  # holds the input until the exchange is over
            total = recv.view(-1, n).sum(0)
            if accumulate:
                out.add_(total, alpha=scale)
            else:
                out.copy_(total.mul_(scale) if scale != 1.0 else total)
        return work, finish
    tmp = torch.empty_like(out) if accumulate else out
    work = dist.reduce_scatter_single(tmp, inp, group=group, async_op=True)

    def finish_native(_keep=inp):
        if accumulate:
            out.add_(tmp, alpha=scale)
        elif scale != 1.0:
            out.mul_(scale)
    return work, finish_native
