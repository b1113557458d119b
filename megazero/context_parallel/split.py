"""The load-balanced split of a sequence over the context-parallel (CP) group.

Causal attention gives late tokens more work than early ones (token t attends to t + 1 keys), so
cutting the sequence into N equal pieces would leave the last CP rank with ~2x the average work.
Megatron-LM's split instead cuts the sequence into 2N chunks and gives CP rank i chunks i and
2N-1-i: every rank then holds one early and one late chunk, and the same amount of causal work.

With CP 2 and 8 tokens: chunks [0 1] [2 3] [4 5] [6 7]; rank 0 holds positions 0 1 6 7 and rank 1
holds 2 3 4 5. Each rank's two chunks are concatenated in that order along the sequence dimension.

Like Megatron-LM, :func:`split_for_cp` requires ``seq_len`` to be divisible by 2N. The attention
itself (:func:`megazero.context_parallel.ring_attention`) only needs every rank's global
positions, so ``allow_uneven=True`` builds a split of any length (chunk sizes differ by at most one,
the longer chunks first, as :func:`torch.tensor_split` cuts), for tests and for callers that
handle unequal shards themselves.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def check_cp_seq_length(seq_len: int, cp_size: int) -> None:
    """Refuse a sequence length the load-balanced split cannot cut into ``2 * cp_size`` equal chunks."""
    if cp_size < 1:
        raise ValueError(f"--context-parallel-size must be at least 1, got {cp_size}")
    chunks = 2 * cp_size
    if cp_size > 1 and seq_len % chunks:
        below, above = seq_len // chunks * chunks, (seq_len // chunks + 1) * chunks
        nearest = f"{below} or {above}" if below > 0 else f"{above}"
        raise ValueError(
            f"--seq-length {seq_len} cannot be split for --context-parallel-size {cp_size}: the "
            f"load-balanced causal split cuts the sequence into 2 x {cp_size} = {chunks} equal chunks "
            f"(CP rank i holds chunks i and {chunks - 1}-i), so the sequence length must be divisible "
            f"by {chunks}; the nearest valid lengths are {nearest}")


def cp_chunk_bounds(seq_len: int, cp_size: int, allow_uneven: bool = False) -> List[Tuple[int, int]]:
    """``(start, end)`` of the ``2 * cp_size`` chunks of a sequence of ``seq_len`` tokens."""
    if not allow_uneven:
        check_cp_seq_length(seq_len, cp_size)
    chunks = 2 * cp_size
    if seq_len < chunks:
        raise ValueError(f"--seq-length {seq_len} is shorter than the {chunks} chunks of "
                         f"--context-parallel-size {cp_size}")
    base, extra = divmod(seq_len, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _rank_bounds(seq_len: int, cp_size: int, cp_rank: int, allow_uneven: bool) -> List[Tuple[int, int]]:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} is outside a context-parallel group of {cp_size}")
    if cp_size == 1:
        return [(0, seq_len)]
    bounds = cp_chunk_bounds(seq_len, cp_size, allow_uneven)
    return [bounds[cp_rank], bounds[2 * cp_size - 1 - cp_rank]]


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, allow_uneven: bool = False,
                 device=None) -> torch.Tensor:
    """The global position ids (``int64 [local_len]``) of the tokens CP rank ``cp_rank`` holds, in
    the order :func:`split_for_cp` lays them out: use them for RoPE and learned position embeddings,
    and pass every rank's to :func:`ring_attention` for the causal mask."""
    return torch.cat([torch.arange(s, e, dtype=torch.long, device=device)
                      for s, e in _rank_bounds(seq_len, cp_size, cp_rank, allow_uneven)])


def split_for_cp(x: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int,
                 allow_uneven: bool = False) -> torch.Tensor:
    """This CP rank's part of ``x``: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of the
    sequence dimension ``seq_dim``, concatenated (a copy; differentiable)."""
    bounds = _rank_bounds(x.shape[seq_dim], cp_size, cp_rank, allow_uneven)
    return torch.cat([x.narrow(seq_dim, s, e - s) for s, e in bounds], dim=seq_dim)


def gather_from_cp(parts: Sequence[torch.Tensor], seq_dim: int, allow_uneven: bool = False) -> torch.Tensor:
    """Inverse of :func:`split_for_cp`: every CP rank's part, in CP rank order -> the whole sequence."""
    cp_size = len(parts)
    seq_len = sum(p.shape[seq_dim] for p in parts)
    pieces = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        bounds = _rank_bounds(seq_len, cp_size, rank, allow_uneven)
        if part.shape[seq_dim] != sum(e - s for s, e in bounds):
            raise ValueError(f"CP rank {rank}'s part has {part.shape[seq_dim]} tokens; the split of "
                             f"{seq_len} tokens gives it {sum(e - s for s, e in bounds)}")
        if cp_size == 1:
            return part
        first = bounds[0][1] - bounds[0][0]
        pieces[rank] = part.narrow(seq_dim, 0, first)
        pieces[2 * cp_size - 1 - rank] = part.narrow(seq_dim, first, part.shape[seq_dim] - first)
    return torch.cat(pieces, dim=seq_dim)
