"""The attention variants' pieces outside the blockwise kernel: masks, attention sinks through SDPA, the
eager kernel of generation, Llama 4's L2 q/k norm and attention temperature.

- Chunked attention (``--attention-chunk-size C``, Llama 4): query ``i`` sees key ``j <= i`` only when
  both lie in the same chunk of positions, ``j // C == i // C`` (:func:`causal_mask`).
- Attention sinks (``--softmax-type learnable`` / ``off-by-one``, gpt-oss): one logit per head joins
  the softmax denominator.  :func:`sink_sdpa` gives it to ``scaled_dot_product_attention`` as one more
  key, seen by every query, whose score is the sink and whose value is zero: queries get one extra
  channel of 1 and that key a channel of ``sink / scale``, the other keys 0 (the extra channels are
  padded to 8 so that fused kernels still apply).  In half precision the sink enters the score rounded
  like any key; the blockwise and ring kernels add it in fp32 instead.
- :func:`eager_attention`: generation's explicit-score kernel (soft-capping, sinks, any mask).
- :func:`l2_norm`: Llama 4's weightless RMS norm of each head's query and key (Megatron-LM's
  ``--qk-l2-norm``).
- :func:`temperature_scales`: Llama 4's attention temperature, ``1 + scale log(1 + floor((p + 1) /
  floor_scale))`` multiplying the queries of token position ``p`` on its NoPE layers.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

SINK_CHANNELS = 8  # extra query/key channels that carry the sink logit (a multiple of 8 for fused kernels)


def causal_mask(seq: int, dtype, device, window: Optional[int] = None,
                chunk: Optional[int] = None) -> torch.Tensor:
    """Additive ``[seq, seq]`` mask (0 seen, -inf hidden): causal, within ``window`` keys before the
    query, and within the query's chunk of ``chunk`` positions."""
    i = torch.arange(seq, device=device)
    hidden = i[None, :] > i[:, None]
    if window is not None:
        hidden = hidden | (i[:, None] - i[None, :] > window)
    if chunk is not None:
        hidden = hidden | (i[:, None] // chunk != i[None, :] // chunk)
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def with_chunks(mask: Optional[torch.Tensor], seq: int, chunk: int, dtype, device) -> torch.Tensor:
    """``mask`` (additive ``[s, s]`` or ``[b, 1, s, s]``, or None: causal) with keys outside each query's
    chunk hidden as well."""
    chunks = causal_mask(seq, dtype, device, chunk=chunk)
    return chunks if mask is None else mask + chunks.to(mask.dtype)


def sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
              mask: Optional[torch.Tensor], scale: Optional[float], dropout_p: float = 0.0) -> torch.Tensor:
    """``scaled_dot_product_attention`` with a sink logit ``sinks [heads]`` per head in every softmax.

    ``q, k, v [b, heads, s, d]`` (key/value heads already repeated to the query heads); ``mask``: the
    additive ``[s, s]`` or ``[b, 1, s, s]`` mask of the keys, None for plain causal attention."""
    b, h, s, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if mask is None:
        mask = causal_mask(s, q.dtype, q.device)
    extra = q.new_zeros(b, h, s, SINK_CHANNELS)
    extra[..., 0] = 1.0
    q1 = torch.cat([q, extra], dim=-1)
    sink_key = torch.cat([q.new_zeros(h, d), (sinks / scale).to(q.dtype)[:, None],
                          q.new_zeros(h, SINK_CHANNELS - 1)], dim=-1)  # [h, d + 8]
    sink_key = sink_key[None, :, None].expand(b, h, 1, d + SINK_CHANNELS)
    k1 = torch.cat([sink_key, F.pad(k, (0, SINK_CHANNELS))], dim=2)
    v1 = torch.cat([v.new_zeros(b, h, 1, d), v], dim=2)
    mask1 = F.pad(mask, (1, 0))  # the sink key, first, is seen by every query
    return F.scaled_dot_product_attention(q1, k1, v1, attn_mask=mask1, dropout_p=dropout_p, scale=scale)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor,
                    scale: Optional[float], softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention with the score matrix formed: ``q [b, h, sq, d]``, ``k, v [b, h, sk, d]``, ``seen``
    a boolean mask broadcasting to ``[b, h, sq, sk]``; soft-capped scores and sink logits optional; the
    softmax in fp32 (float64 for float64 inputs)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~seen, float("-inf"))
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1, dtype=work).to(q.dtype), v)
    sink = sinks.to(work).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores.to(work), sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over each head's channels, in fp32 (no scale)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query scale per token, shaped to multiply ``q [b, heads, s, d]``: ``positions [s]`` ->
    ``[1, 1, s, 1]``, ``[b, s]`` -> ``[b, 1, s, 1]``."""
    t = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return t.view(1, 1, -1, 1) if t.dim() == 1 else t[:, None, :, None]
