"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in chunked form.

The recurrence, per head (state ``S [dk, dv]``; ``g_t <= 0`` the log-decay, ``beta_t`` in (0, 1))::

    S'_t = exp(g_t) S_{t-1}
    S_t  = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T          o_t = S_t^T q_t

Write ``u_t = beta_t (v_t - S'_t^T k_t)`` for what position ``t`` writes.  Inside a chunk that starts
from state ``S_0``, with ``G_t`` the cumulative log-decay from the chunk's start to ``t`` (inclusive)::

    S_t = exp(G_t) S_0 + sum_{j <= t} exp(G_t - G_j) k_j u_j^T
    u_t + beta_t sum_{j < t} exp(G_t - G_j) (k_t . k_j) u_j = beta_t v_t - beta_t exp(G_t) S_0^T k_t

a unit lower-triangular system ``(I + A) u = beta v - (beta exp(G) k) S_0`` solved once per chunk for
both right-hand sides (``U0 = (I + A)^-1 beta v``, ``W = (I + A)^-1 beta exp(G) k``, in parallel over
chunks), so that ``u = U0 - W S_0`` once the chunk's starting state is known.  Then
``o_t = exp(G_t) S_0^T q_t + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) u_j`` and the state at the chunk's
end follows; only that last step runs chunk after chunk (:func:`chunk_step`).  Differentiable
PyTorch throughout (the triangular solve included), so the backward is autograd's.  Lengths that
are not multiples of the chunk are padded with ``k = v = 0, beta = 0, g = 0`` positions, which
leave the state unchanged.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .ssd import segsum


def chunk_step(S: torch.Tensor, U0: torch.Tensor, W: torch.Tensor, q_decayed: torch.Tensor,
               scores: torch.Tensor, k_to_end: torch.Tensor, total: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One chunk from its starting state ``S [b, h, dk, dv]``: its outputs ``[b, h, L, dv]`` and the
    state at its end.  ``U0 [.., L, dv]``, ``W [.., L, dk]`` (the solved system), ``q_decayed = exp(G) q``,
    ``scores [.., L, L] = (q_t . k_j) exp(G_t - G_j)`` (causal), ``k_to_end = exp(G_L - G_j) k_j``,
    ``total = G_L [b, h]``."""
    u = U0 - W @ S
    out = q_decayed @ S + scores @ u
    return out, torch.exp(total)[..., None, None] * S + k_to_end.transpose(-1, -2) @ u


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, chunk_size: int, initial_state: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rule of the module docstring.  ``q, k [b, s, h, dk]`` (as the rule uses them: normalised
    and scaled by the caller), ``v [b, s, h, dv]``, ``g, beta [b, s, h]``, ``initial_state
    [b, h, dk, dv]`` or None.  Returns ``o [b, s, h, dv]`` and the final state, in fp32 at least."""
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    L = chunk_size
    work = torch.promote_types(q.dtype, torch.float32)
    pad = (-s) % L
    c = (s + pad) // L

    def chunks(t):  # [b, s, h, ...] -> [b, h, c, L, ...]
        t = F.pad(t.to(work), (0, 0) * (t.dim() - 3) + (0, 0, 0, pad))
        return t.view(b, c, L, h, *t.shape[3:]).transpose(1, 3).transpose(2, 3)
    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(-1)  # [b, h, c, L]
    decay = torch.exp(segsum(g))  # [.., t, j] = exp(G_t - G_j) for j <= t, 0 above
    eye = torch.eye(L, dtype=work, device=q.device)
    system = eye + (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([beta[..., None] * v, (beta * torch.exp(G))[..., None] * k], dim=-1)
    U0, W = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], -1)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = torch.exp(G)[..., None] * q
    k_to_end = torch.exp(G[..., -1:] - G)[..., None] * k

    S = (initial_state.to(work) if initial_state is not None
         else q.new_zeros(b, h, dk, dv))
    outs = []
    for i in range(c):
        out, S = chunk_step(S, U0[:, :, i], W[:, :, i], q_decayed[:, :, i], scores[:, :, i],
                            k_to_end[:, :, i], G[:, :, i, -1])
        outs.append(out)
    o = torch.stack(outs, 2).reshape(b, h, c * L, dv)[:, :, :s]
    return o.transpose(1, 2), S
