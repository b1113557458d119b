"""Context parallelism for the recurrent mixers: what crosses CP ranks at chunk boundaries.

Under context parallelism the sequence is cut into ``2 N`` chunks and CP rank ``i`` holds chunks
``i`` and ``2N - 1 - i`` (:mod:`megazero.context_parallel.split`), concatenated.  A recurrent layer
needs, at the start of each of its chunks, what the chunks before it left:

- the short causal conv: the last ``kernel - 1`` inputs of the previous chunk (:func:`conv_states`);
- the recurrence: the state at the end of the previous chunk.  Each rank runs its chunks from a zero
  state; the state every chunk leaves is then an affine function of the state it started from,
  ``S_end = T S_start + S_zero`` (``T`` a per-head decay for Mamba-2), so the true starting states
  follow from every chunk's ``(T, S_zero)`` by one pass over the ``2 N`` chunks in order
  (:func:`starting_states`), done on every rank from an all-gather (the pieces are a state per
  chunk); each rank then adds what its chunks read of their starting state.

The all-gather is differentiable: its backward sums every rank's gradient of the gathered pieces
and hands each rank its own (:class:`_GatherCP`).
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch
import torch.distributed as dist


class _GatherCP(torch.autograd.Function):
    """``[cp, ...]``: every CP rank's ``x``; backward: the gradients of this rank's piece summed over
    the ranks."""

    @staticmethod
    def forward(ctx, x, group, size: int, rank: int):
        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def gather_cp(x: torch.Tensor, mesh) -> torch.Tensor:
    return _GatherCP.apply(x, mesh.group("cp"), mesh.size("cp"), mesh.coord("cp"))


def global_chunks(gathered: torch.Tensor) -> List[torch.Tensor]:
    """``gathered [cp, 2, ...]`` (each rank's two chunks' pieces) -> the ``2 cp`` pieces in sequence
    order (chunk ``c`` is rank ``c``'s first for ``c < cp``, rank ``2 cp - 1 - c``'s second after)."""
    cp = gathered.shape[0]
    return [gathered[c, 0] if c < cp else gathered[2 * cp - 1 - c, 1] for c in range(2 * cp)]


def my_chunks(mesh) -> tuple:
    """The global indices of this CP rank's two chunks."""
    cp, rank = mesh.size("cp"), mesh.coord("cp")
    return rank, 2 * cp - 1 - rank


def conv_states(tails: Sequence[torch.Tensor], mesh) -> List[torch.Tensor]:
    """``tails``: the last ``kernel - 1`` conv inputs ``[b, k - 1, ch]`` of this rank's two chunks ->
    the conv state of each (the previous chunk's tail; zeros before the first chunk)."""
    every = global_chunks(gather_cp(torch.stack(list(tails)), mesh))
    return [every[c - 1] if c > 0 else torch.zeros_like(tails[0]) for c in my_chunks(mesh)]


def starting_states(finals: Sequence[torch.Tensor], transitions: Sequence[torch.Tensor],
                    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mesh) -> List[torch.Tensor]:
    """The state each of this rank's two chunks starts from.  ``finals``: the states they end with
    from a zero start; ``transitions``: what maps a chunk's starting state to its share of the end
    state, ``apply(transition, state)``."""
    finals_all = global_chunks(gather_cp(torch.stack(list(finals)), mesh))
    trans_all = global_chunks(gather_cp(torch.stack(list(transitions)), mesh))
    state, starts = torch.zeros_like(finals[0]), []
    for c in range(len(finals_all)):
        starts.append(state)
        state = apply(trans_all[c], state) + finals_all[c]
    return [starts[c] for c in my_chunks(mesh)]
