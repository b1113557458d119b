"""Mamba-2's selective state-space scan in its chunked form (state-space duality, SSD).

The recurrence, per head ``h`` (state ``S [p, n]``, ``p`` the head dimension, ``n`` the state size)::

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t B_t^T          y_t = S_t C_t

with ``dt_t > 0`` and ``A < 0`` per head, and ``B_t, C_t [n]`` shared by the heads of a group.  The
sequence is cut into chunks of ``chunk_size`` positions.  Inside a chunk the output is a masked
"attention" ``y_l = sum_{s <= l} (C_l . B_s) exp(sum_{s < k <= l} dt_k A) dt_s x_s`` (a quadratic
product, like attention's, over ``chunk_size`` positions only); each chunk's contribution to the
state at its end is a sum over its positions; the states at the chunk boundaries follow by the
same recurrence over chunks (:func:`pass_states`); and each position adds its chunk's starting
state, decayed to it and read out by ``C``.  Everything is differentiable PyTorch, so the backward
is autograd through the chunked math.  Lengths that are not multiples of the chunk are padded with
``dt = 0`` positions, which neither decay nor add to the state.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``a [..., L]`` -> ``[..., L, L]`` with entry ``[l, s] = a_{s+1} + ... + a_l`` for ``l >= s``
    (0 on the diagonal) and ``-inf`` above it, summed directly rather than as a difference of
    cumulative sums (which would cancel large terms)."""
    L = a.shape[-1]
    ones = torch.ones(L, L, dtype=torch.bool, device=a.device)
    rep = a.unsqueeze(-1).expand(*a.shape, L)  # [..., k, s] = a_k
    summed = rep.masked_fill(~torch.tril(ones, -1), 0).cumsum(-2)  # [l, s] = sum over s < k <= l
    return summed.masked_fill(~torch.tril(ones), float("-inf"))


def pass_states(chunk_states: torch.Tensor, chunk_decay: torch.Tensor,
                initial: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The states at every chunk's start and at the end of the last.

    ``chunk_states [b, c, g, r, p, n]``: what each chunk adds to the state at its end (from a zero
    start); ``chunk_decay [b, g, r, c]``: each chunk's total log-decay; ``initial [b, g, r, p, n]`` or
    None (zeros).  Returns ``starts [b, c, g, r, p, n]`` and ``final [b, g, r, p, n]``."""
    if initial is None:
        initial = torch.zeros_like(chunk_states[:, 0])
    every = torch.cat([initial.unsqueeze(1).to(chunk_states.dtype), chunk_states], dim=1)
    decay = torch.exp(segsum(F.pad(chunk_decay, (1, 0))))  # [b, g, r, c + 1, c + 1]
    states = torch.einsum("bgrzw,bwgrpn->bzgrpn", decay, every)
    return states[:, :-1], states[:, -1]


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, initial_state: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan of the module docstring.  ``x [b, s, h, p]``, ``dt [b, s, h]`` (positive: after the
    bias and softplus), ``A [h]`` (negative), ``B, C [b, s, g, n]`` (heads ``g * r .. g * r + r - 1``
    read group ``g``), ``initial_state [b, h, p, n]`` or None.  Returns ``y [b, s, h, p]`` (without
    the ``D`` skip) and the final state ``[b, h, p, n]``, both in fp32 at least (float64 stays)."""
    b, s, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"{h} heads do not divide into {g} groups")
    r, L = h // g, chunk_size
    work = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (t.to(work) for t in (x, dt, A, B, C))
    pad = (-s) % L
    c = (s + pad) // L
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(b, c, L, g, r, p)
    a = F.pad(dt * A, (0, 0, 0, pad)).view(b, c, L, g, r).permute(0, 3, 4, 1, 2)  # [b, g, r, c, L]
    B = F.pad(B, (0, 0, 0, 0, 0, pad)).view(b, c, L, g, n)
    C = F.pad(C, (0, 0, 0, 0, 0, pad)).view(b, c, L, g, n)
    cum = a.cumsum(-1)

    # within each chunk: scores C_l . B_s, decayed from s to l, causal
    weights = torch.einsum("bclgn,bcsgn->bgcls", C, B).unsqueeze(2) * torch.exp(segsum(a))
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", weights, xdt)

    # each chunk's own contribution to the state at its end, then the states at chunk boundaries
    to_end = torch.exp(cum[..., -1:] - cum).permute(0, 3, 4, 1, 2).unsqueeze(-1)  # [b, c, L, g, r, 1]
    chunk_states = torch.einsum("bclgn,bclgrp->bcgrpn", B, xdt * to_end)
    init = None if initial_state is None else initial_state.to(work).view(b, g, r, p, n)
    starts, final = pass_states(chunk_states, cum[..., -1], init)

    # each position reads its chunk's starting state, decayed to it
    from_start = torch.exp(cum).permute(0, 3, 4, 1, 2).unsqueeze(-1)  # [b, c, L, g, r, 1]
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", C, starts) * from_start
    return y.reshape(b, c * L, h, p)[:, :s], final.reshape(b, h, p, n)
