"""Collectives under their current names on every supported torch.

torch renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single``; megazero calls the new names where they exist and the old ones
otherwise, from this one place.
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
