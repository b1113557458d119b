"""The per-token loss of a context-parallel rank, gathered into the whole sequence.

Each CP rank computes the loss of the tokens it holds (``[b, s / N]``, in the load-balanced order of
:func:`megazero.context_parallel.split_for_cp`). :func:`gather_cp_loss` all-gathers them over the CP
group and puts them back in sequence order, so every CP rank holds the same ``[b, s]`` per-token
loss and takes the same global token mean of it, as one process would: the loss is the global
token mean, whatever N is.

Backward hands each rank the gradient of its own tokens, times N. Every CP rank runs the same
backward of the same loss, so the gradient a rank's parameters receive covers its own tokens only,
and the parameter gradient is the *sum* over the CP group of the ranks' gradients. The gradient
reduction averages over the dp x cp group (as a data-parallel group of dp x cp ranks, the way
Megatron-LM's distributed optimizer shards over it), which divides by N too many times; the factor
N here undoes that (Megatron-LM scales the loss by the context-parallel size for the same reason).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megazero.context_parallel.split import gather_from_cp, split_for_cp


class _GatherLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group, cp_size: int, cp_rank: int):
        ctx.group, ctx.cp_size, ctx.cp_rank = group, cp_size, cp_rank
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(cp_size)]
        dist.all_gather(parts, local, group=group)
        return gather_from_cp(parts, seq_dim=1)

    @staticmethod
    def backward(ctx, grad):
        mine = split_for_cp(grad, 1, ctx.cp_size, ctx.cp_rank)
        return mine * ctx.cp_size, None, None, None


def gather_cp_loss(local: torch.Tensor, group, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``local [b, s / cp_size, ...]`` per-token losses (or logits) of this CP rank -> ``[b, s, ...]`` of
    the whole sequence (the same on every CP rank); backward as the module docstring says."""
    if cp_size == 1:
        return local
    return _GatherLoss.apply(local, group, cp_size, cp_rank)
