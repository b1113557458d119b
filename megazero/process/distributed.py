"""Collectives under their current names on every supported torch.

torch renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single``; megazero calls the new names where they exist and the old ones
otherwise, from this one place.  :func:`gather_shards` is the all-gather ZeRO uses for its
buffers: on gloo without the output-sized temporary gloo's all-gather allocates.
"""
from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, input, group=None, async_op: bool = False):  # noqa: A002 - torch's name
    """Gather every rank's ``input`` into ``output`` (rank order, concatenated along dim 0)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op: bool = False,  # noqa: A002 - torch's name
                          op=None):
    """Sum ``input`` over the ranks (or reduce with ``op``) and keep this rank's slice (dim 0) in
    ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if op is None:
        return fn(output, input, group=group, async_op=async_op)
    return fn(output, input, op=op, group=group, async_op=async_op)


class Works:
    """Several asynchronous collectives as one handle (``wait``, ``is_completed``)."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def gather_shards(output, input, group=None, async_op: bool = False):  # noqa: A002 - torch's name
    """:func:`all_gather_single` of the 1-D ``input`` into the contiguous 1-D ``output``.  gloo's
    all-gather gathers into a temporary as large as ``output`` and copies it over (a ZeRO-3 unit's
    whole size, once more, at every gather); on gloo this copies ``input`` into this rank's slice
    (nothing to copy when it is that slice) and every rank broadcasts its slice in place."""
    if dist.get_backend(group) != "gloo":
        return all_gather_single(output, input, group=group, async_op=async_op)
    size, rank, n = dist.get_world_size(group), dist.get_rank(group), input.numel()
    mine = output[rank * n:(rank + 1) * n]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    src = [r if group is None else dist.get_global_rank(group, r) for r in range(size)]
    works = Works(dist.broadcast(output[r * n:(r + 1) * n], src=src[r], group=group, async_op=True)
                  for r in range(size))
    if async_op:
        return works
    works.wait()
    return None
