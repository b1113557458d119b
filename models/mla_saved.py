"""What multi-latent attention (:mod:`megazero_models.mla`) saves for backward: the part of the model's
declaration (:mod:`megazero_models.saved_activations`, which hands MLA layers here) that the memory
estimator reads.  Per micro-batch on one rank, in the notation of
:class:`megazero.planning.activations.Dims` and its ``mla`` sizes (``rq``, ``rkv``, ``dn``, ``dr``,
``dv``); ``n = ap`` heads on this rank, ``W = max(dn + dr, dv)`` the head size the kernel sees:

- the down-projections keep their input ``E Tl h`` (this rank's tokens); without ``--q-lora-rank``
  the query projection keeps it too, gathered along the sequence under sequence parallelism
  (``E T h``, a copy);
- with ``--qk-layernorm`` each latent's norm keeps what a norm of that width keeps
  (:func:`megazero_models.saved_activations.norm_bytes`); the key/value norm's input is a view of
  the down-projection's output, whose rotary part ``E Tl dr`` it then keeps too (fp32 RMSNorm and
  LayerNorm keep the input itself; half-precision RMSNorm an fp32 copy of the view);
- the up-projections keep the latents of every token, one storage ``E T (rq + rkv + dr)`` (the
  gathered copy under sequence parallelism);
- RoPE keeps nothing per layer (the chunk's ``cos``/``sin`` of ``dr`` channels are shared);
- the kernel: the query and key ``E T n W`` each (concatenations, or padded copies when the values are
  wider), the values zero-padded to ``W`` when narrower (else a view of the key/value
  up-projection's output ``E T n (dn + dv)``),
  flash/efficient/blockwise/ring: the output ``E T n W`` and the fp32 log-sum-exp; math (attention
  dropout on CPU): the scaled query and key, the probabilities and, with dropout, the mask and the
  dropped probabilities, as :func:`megazero_models.saved_activations.core_bytes` says; Ulysses: the
  all-to-all'ed query, key and values, its output and log-sum-exp;
- the output projection keeps the output regrouped, ``E T n dv`` (a copy: the output is cut to
  ``dv`` channels, or laid out by head).

Selective recomputation keeps the core's inputs (query, key, the values' storage) and its output;
the replay saves the kernel's set besides its inputs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict

from megazero.offload.element_bytes import FP32
from megazero.planning.activations import Dims


def _heads(D: Dims, width: int) -> int:
    return D.E * D.T * D.ap * width


def _width(D: Dims) -> int:
    """The head size the kernel sees: the query's, or the values' when wider."""
    L = D.mla
    return max(L.dn + L.dr, L.dv)


def _lse(D: Dims) -> int:
    s = -(-D.s // 32) * 32 if D.backend == "efficient" else D.s
    return FP32 * D.b * D.ap * s


def input_bytes(D: Dims) -> int:
    """The projections' input: ``E Tl h``, and the query projection's gathered copy ``E T h`` without
    --q-lora-rank under sequence parallelism."""
    return D.E * D.Tl * D.h + (D.E * D.T * D.h if not D.mla.rq and D.sp else 0)


def proj_input_bytes(D: Dims) -> int:
    """The output projection's regrouped input ``E T n dv``."""
    return _heads(D, D.mla.dv)


def _latent_bytes(D: Dims) -> int:
    """The latent norms and the latents the up-projections keep."""
    from .saved_activations import norm_bytes
    L = D.mla
    out = D.E * D.T * (L.rq + L.rkv + L.dr)
    if L.norm:
        out += norm_bytes(replace(D, h=L.rq)) if L.rq else 0
        out += norm_bytes(replace(D, h=L.rkv)) + (0 if D.rms and D.half else D.E * D.Tl * L.dr)
    return out


def _values(D: Dims) -> int:
    """The values as the kernel gets them: padded to ``W`` when narrower than the query, else a view of
    the key/value up-projection's output ``E T n (dn + dv)``."""
    L = D.mla
    return _heads(D, _width(D)) if L.dv < L.dn + L.dr else _heads(D, L.dn + L.dv)


def _kernel(D: Dims) -> Dict[str, int]:
    """What the kernel saves, its inputs included (the query and key at ``W``: padded copies when the
    values are wider), and the projection's copy."""
    w = _width(D)
    if D.backend == "ulysses":
        return {"a2a": 3 * _heads(D, w), "out": _heads(D, w), "lse": _lse(D), "proj": proj_input_bytes(D)}
    if D.backend == "math":
        probs = D.b * D.ap * D.s * D.s
        out = dict(scaled_q=_heads(D, w), scaled_k=_heads(D, w), v=_values(D), probs=probs * D.E,
                   proj=proj_input_bytes(D))
        if D.attention_dropout:
            out["dropped"] = probs * (D.E + D.M)
        return out
    return dict(q=_heads(D, w), k=_heads(D, w), v=_values(D), out=_heads(D, w), lse=_lse(D),
                proj=proj_input_bytes(D))


def core_bytes(D: Dims) -> int:
    """What an MLA layer's attention keeps besides its input (module docstring)."""
    return _latent_bytes(D) + sum(_kernel(D).values())


def selective_kept(D: Dims) -> int:
    """The recomputed core's inputs (the query and key ``E T n (dn + dr)`` each, the values' storage, the
    key/value up-projection's output ``E T n (dn + dv)``) and its output (kept by the projection)."""
    L = D.mla
    return (_latent_bytes(D) + 2 * _heads(D, L.dn + L.dr) + _heads(D, L.dn + L.dv)
            + proj_input_bytes(D))


def selective_replay(D: Dims) -> int:
    """The core's replay: the kernel's set without the projection's copy and without the inputs that
    the forward kept (the padded copies are made inside the replay, so they count)."""
    saved = _kernel(D)
    saved.pop("proj")
    L = D.mla
    if L.dv >= L.dn + L.dr and D.backend != "ulysses":
        saved.pop("v")  # the kept storage
    if D.backend not in ("ulysses", "math") and L.dv <= L.dn + L.dr:  # as kept, not padded copies
        saved.pop("q")
        saved.pop("k")
    return sum(saved.values())
