"""Rotary position embeddings (RoPE) and their scalings, computed as Hugging Face computes them.

:func:`rope_scaling_of` reads a ModelConfig's scaling into a small dict; :func:`rope_cos_sin` gives
the fp32 ``cos, sin [seq, dim]`` tables (half-split ``rotate_half`` layout) for positions
``0 .. seq - 1``:

- plain RoPE: ``inv_freq_i = base^(-2i / d)``;
- LLaMA-3.x (``llama3``): long wavelengths divided by the factor, short ones kept, a smooth blend
  between;
- linear position interpolation (``linear``): frequencies divided by the factor;
- YaRN (``yarn``, Megatron-LM's ``--position-embedding-type yarn``): frequencies blended between
  ``inv_freq / factor`` and ``inv_freq`` by a linear ramp over the dimensions whose rotations in the
  original context lie between ``beta_slow`` and ``beta_fast``; ``cos`` and ``sin`` are multiplied
  by the attention factor ``(0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1)``;
- dynamic NTK (``dynamic``): a table of ``L > max_position_embeddings`` positions uses the base
  ``base (f L / max - f + 1)^(d / (d - 2))``, computed from ``L`` alone (Hugging Face keeps the
  largest ``L`` seen in its module; for growing lengths, as in generation, the two agree).

Partial rotary (``--rotary-percent p``, GLM-4.5): the tables cover the first ``int(p d)`` channels of a
head, which :func:`apply_rope` rotates (halves of that part, as Hugging Face and Megatron-LM do), the
rest pass through.  Gemma 3 (``--rotary-base-local``): windowed layers use plain RoPE of that base,
the others the model's base and scaling; :func:`rope_tables` returns both, and the token positions
when attention temperature tuning needs them (:class:`RopeTables`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch

Select = Callable[[torch.Tensor], torch.Tensor]  # a full [L, dim] table -> the rows of the tokens


class RopeTables(tuple):
    """``(cos, sin)`` of the model's RoPE for the tokens, carrying ``local`` (Gemma 3's windowed layers'
    ``(cos, sin)``, or None) and ``positions`` (the tokens' positions ``[s]`` or ``[b, s]``, or None)."""
    local: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    positions: Optional[torch.Tensor] = None


def rotary_dim(m) -> int:
    """The channels of a head that RoPE rotates (``--rotary-percent`` of ``--kv-channels``)."""
    return int(m.kv_channels * getattr(m, "rotary_percent", 1.0))


def rope_tables(m, length: int, device, select: Select, positions=None):
    """The tokens' ``(cos, sin)`` of a ModelConfig's RoPE: the tables of positions ``0 .. length - 1``
    through ``select``; ``positions``: the tokens' positions (a tensor, or a function giving it).  A plain
    tuple unless the model has a local base (Gemma 3) or attention temperature tuning (Llama 4), which
    need :class:`RopeTables`' ``local`` and ``positions``."""
    dim = rotary_dim(m)
    cos, sin = rope_cos_sin(length, dim, m.rotary_base, device, rope_scaling_of(m))
    tables = (select(cos), select(sin))
    local_base = getattr(m, "rotary_base_local", None)
    if local_base is None and not getattr(m, "attn_temperature_tuning", False):
        return tables
    out = RopeTables(tables)
    if local_base is not None:
        lcos, lsin = rope_cos_sin(length, dim, local_base, device)
        out.local = (select(lcos), select(lsin))
    out.positions = positions() if callable(positions) else positions
    return out


def rope_scaling_of(m) -> Dict[str, Any]:
    """The RoPE scaling of a ModelConfig: ``{}`` or keys ``llama3`` (factor), ``low``, ``high``,
    ``original`` (LLaMA-3.x), ``linear`` (interpolation factor), ``yarn`` (a dict of its settings)
    and ``dynamic`` (factor, with ``max`` positions)."""
    out: Dict[str, Any] = {}
    if m.use_rope_scaling:
        out.update(llama3=m.rope_scaling_factor, low=m.rope_scaling_low_freq_factor,
                   high=m.rope_scaling_high_freq_factor,
                   original=m.rope_scaling_original_max_position_embeddings)
    if m.rotary_seq_len_interpolation_factor is not None:
        out["linear"] = m.rotary_seq_len_interpolation_factor
    if m.position_embedding_type == "yarn":
        out["yarn"] = dict(factor=m.rotary_scaling_factor, original=m.yarn_original_max_position_embeddings,
                           beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow,
                           round=m.yarn_correction_range_round_to_int, mscale=m.mscale,
                           mscale_all_dim=m.mscale_all_dim)
    if m.dynamic_rope_scaling_factor is not None:
        out.update(dynamic=m.dynamic_rope_scaling_factor, max=m.max_position_embeddings)
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(y: Dict[str, Any]) -> float:
    """What YaRN multiplies ``cos`` and ``sin`` by (Megatron-LM's concentration factor)."""
    return yarn_mscale(y["factor"], y["mscale"]) / yarn_mscale(y["factor"], y["mscale_all_dim"])


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, y: Dict[str, Any]) -> torch.Tensor:
    def correction_dim(rotations):
        return dim * math.log(y["original"] / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(y["beta_fast"]), correction_dim(y["beta_slow"])
    if y["round"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    ramp = ramp.to(inv_freq.device)
    extrapolate = 1 - ramp  # 1: keep the frequency, 0: divide it by the factor
    return inv_freq / y["factor"] * (1 - extrapolate) + inv_freq * extrapolate


def _dynamic_base(base: float, dim: int, seq: int, factor: float, max_pos: int) -> torch.Tensor:
    """Dynamic NTK's base for a table of ``seq`` positions, in fp32 tensor arithmetic as transformers
    computes it."""
    length = torch.tensor(max(seq, max_pos), dtype=torch.int64)
    return base * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def rope_inv_freq(dim: int, base: float, device, scaling: Optional[Dict[str, Any]] = None,
                  seq: int = 0) -> torch.Tensor:
    """fp32 rotary frequencies ``[dim / 2]`` (``scaling`` from :func:`rope_scaling_of`; ``seq``: the
    table length, which dynamic scaling depends on)."""
    scaling = scaling or {}
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if "dynamic" in scaling and seq > scaling["max"]:
        big = _dynamic_base(base, dim, seq, scaling["dynamic"], scaling["max"]).to(device)
        inv_freq = 1.0 / (big ** exponents)
    else:
        inv_freq = 1.0 / (base ** exponents)
    if "llama3" in scaling:
        factor, low, high, original = (scaling[k] for k in ("llama3", "low", "high", "original"))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long waves: slowed down
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    if "yarn" in scaling:
        inv_freq = _yarn_inv_freq(inv_freq, dim, base, scaling["yarn"])
    if "linear" in scaling:
        inv_freq = inv_freq / scaling["linear"]
    return inv_freq


def rope_cos_sin(seq: int, dim: int, base: float, device,
                 scaling: Optional[Dict[str, Any]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[seq, dim]`` in Hugging Face's half-split layout."""
    scaling = scaling or {}
    inv_freq = rope_inv_freq(dim, base, device, scaling, seq)
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    if "yarn" in scaling:
        factor = yarn_attention_factor(scaling["yarn"])
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, d]`` (HF ``rotate_half``: pairs are ``(i, i + r/2)``), in fp32; tables
    ``[.., r]`` narrower than ``d`` rotate the first ``r`` channels and pass the rest (partial rotary)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)
