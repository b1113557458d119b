"""What megazero's GPT (:mod:`megazero_models.gpt`, :mod:`megazero_models.layers`, and the engine's
tensor-parallel layers, cross-entropy and recomputation it is built from) saves for backward: the
model's declaration, which the memory estimator (:mod:`megazero.planning.activations`) walks over
the pipeline schedule.  Change a layer's forward, change its entry here: ``tests/test_memory.py``
measures what autograd keeps and holds these figures to it.

Every term is a tensor that an autograd node saves (one storage counted once, parameters left
out), per micro-batch, on one rank, in the notation of :class:`megazero.planning.activations.Dims`.

Per transformer layer (no recomputation):

- each norm (computed in fp32): LayerNorm keeps its fp32 input ``4 Tl h`` (the layer input
  itself in fp32, a copy in half precision), mean and rstd ``2 * 4 Tl``; RMSNorm keeps the fp32
  input ``4 Tl h``, the rsqrt ``4 Tl`` and the normalised product ``4 Tl h``; in half precision
  both keep fp32 copies of their weight (and bias): ``4 h`` each;
- with ``--norm-position post`` the norms act on the sublayer outputs instead, ``sandwich`` has
  four per layer; each keeps what a norm keeps;
- the QKV projection keeps its input ``E T h`` (the norm output, the layer input without a norm
  before attention, or the sequence-gathered copy);
- q/k norms (:func:`_qk_path`) keep their input (the QKV output, or the regrouped query), rsqrt and
  normalised product; the core then sees their (rotated) output;
- attention, flash/efficient SDPA (CPU without attention dropout, CUDA): the query storage, the
  key and value after ``repeat_interleave`` (copies, ``2 E T ap d``; with grouped-query attention on
  CUDA's flash kernel without a window, ``enable_gqa`` instead: the grouped ones), the output
  ``E T ap d`` and the fp32 log-sum-exp ``4 b ap s`` (efficient kernel: ``s`` rounded up to 32).
  The query is a view of the fused QKV output when there is no RoPE and one query head per group
  (GPT-2), so the whole QKV output ``E T (ap + 2 gp) d`` stays alive; otherwise it is its own
  ``E T ap d`` (rotated, or regrouped).  The output projection keeps a regrouped copy of the SDPA
  output ``E T ap d``, except on CPU when the query was a view of the QKV output (the output then
  regroups as a view unless grouped-query attention regrouped the query).  Math SDPA (CPU with
  attention dropout): the scaled query and key
  ``2 E T ap d``, the value ``E T ap d``, the softmax, the dropout mask and the dropped
  probabilities ``b ap s^2 (2 E + M)`` (the ``5 a s^2 b`` term of Korthikanti et al. exists
  only here), and the regrouped output ``E T ap d`` for the projection;
- soft-capped attention runs in the blockwise kernel, which keeps q, k, v as given, its output,
  the fp32 log-sum-exp and the projection's regrouped copy, as ring attention does;
- RoPE keeps fp32 ``cos`` and ``sin`` ``2 * 4 s d`` once per chunk forward (shared by its layers),
  and so does a sliding window its additive mask ``E s^2`` (SDPA's flash/efficient kernels keep
  it; per distinct window, only where the window hides keys; :func:`shared_bytes`);
- a chunked layer (``--attention-chunk-size`` shorter than the sequence) its own additive mask ``E s^2``
  (:func:`chunk_mask_bytes`); a second pair of RoPE tables with ``--rotary-base-local``; a NoPE layer
  with ``--attn-temperature-tuning`` its fp32 query scale ``4 s``;
- each hidden dropout keeps its mask ``M Tl h``;
- the MLP keeps its input ``E T h`` (twice under sequence parallelism with SwiGLU: gate and fc1
  each gather it), GELU its input and output ``2 E T fp``, SwiGLU the gate output, its SiLU, the
  fc1 output and the product ``4 E T fp``; quick-GeGLU one more ``E T fp`` (its sigmoid), the GLU clamp
  (``--activation-func-clamp-value``) two (the clamps' inputs).  Not counted: attention sinks' SDPA
  key, the L2 q/k norm, partial rotary's copies, the experts' quick-GeGLU and clamp
  (docs/attention.md).

A hybrid stack's layer (``--hybrid-layer-pattern``; ``Dims.kind``) is one pre-norm block: its norm, one
sublayer and one dropout mask (``*`` the attention half, ``-``/``E`` the MLP or MoE half); an ``M`` or
``G`` layer's mixer, and Gated DeltaNet in a transformer layer's attention place
(``--linear-attention-freq``), keep what :mod:`megazero_models.ssm_saved` lists.  The attention output
gate (``--attention-output-gate``) adds its sigmoid's output and the gated product (and under sequence
parallelism its own gathered input): :func:`gate_bytes`.

An MoE layer (``--num-experts``, in the layers ``--moe-layer-freq`` names) keeps, in place of the
MLP, what :func:`moe_bytes` lists: its input, the router's scores and losses, the routed pairs'
indices, the experts' rows and intermediates for the ``P`` top-k pairs (``R`` rows at the experts,
``P`` gathered over expert TP), the combine's fp32 weighted outputs, and the shared expert with its
gate; balanced routing assumed (:class:`megazero.planning.activations.MoEDims`).

Embedding (first stage): the token ids ``8 T`` (with TP > 1 the shifted ids ``8 T`` and the
out-of-range mask ``T``), Gemma's scale ``E``, the dropout mask ``M Tl h``.  Head and loss (last
stage): the final norm, the head's input ``E T h``, a final soft-cap's tanh output ``E T Vp``, the
cross-entropy's fp32 softmax ``4 T Vp``, shifted labels
``8 T``, ownership mask ``T`` and vocabulary mask ``Vp``; the executor's loss keeps the loss mask
``4 T`` and one fp32 scalar.

"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from megazero.offload.element_bytes import FP32
from megazero.config.hybrid import MLP as MLP_KIND, MOE as MOE_KIND
from megazero.planning.activations import Dims, Segment
from . import mla_saved, ssm_saved
from .mtp_saved import mtp_segments  # noqa: F401 - multi-token prediction's part


def norm_bytes(D: Dims) -> int:
    """One LayerNorm/RMSNorm over ``Tl`` tokens (``models.layers.Norm``: the fused kernels on the
    compute-dtype input, weights passed as parameters, so no weight copies are saved).

    LayerNorm (``F.layer_norm``): its input ``E Tl h`` (the input itself) and mean and rstd, one
    per token, in the input's dtype on CPU (``E``) and fp32 on CUDA.  RMSNorm (``F.rms_norm``,
    which on CPU decomposes into fp32 ops): the fp32 input ``4 Tl h`` (a copy in half precision,
    the input itself in fp32), the rsqrt ``4 Tl`` and the normalised product ``4 Tl h`` (the
    weight multiply saves the weight, a parameter: not counted).  Measured on CPU (torch 2.13);
    the CUDA RMSNorm figure assumes the same decomposition (not measured here)."""
    if D.rms:
        return FP32 * D.Tl * D.h * 2 + FP32 * D.Tl
    stats = D.E if D.device == "cpu" else FP32
    return D.E * D.Tl * D.h + 2 * stats * D.Tl


def dropout_bytes(D: Dims) -> int:
    """One hidden dropout's mask (0 without dropout)."""
    return D.M * D.Tl * D.h if D.hidden_dropout else 0


def _qkv_out(D: Dims) -> int:
    return D.E * D.T * (D.ap + 2 * D.gp) * D.d


def _heads(D: Dims) -> int:
    """Bytes of one ``[b, ap, s, d]`` tensor."""
    return D.E * D.T * D.ap * D.d


def _query_is_view(D: Dims) -> bool:
    """Whether ``Attention.split_qkv``'s query is a view of the QKV output: the ``[s, b, g, n, d]``
    split reshapes to ``[s, b, g * n, d]`` without a copy with one query head per group, or one
    group on this rank (otherwise ``reshape`` copies it)."""
    return D.ap == D.gp or D.gp == 1


def _grouped(D: Dims) -> bool:
    """Grouped-query attention (``q_per_group > 1``): ``Attention.core`` repeats the keys and
    values (``repeat_interleave``: copies); with one query head per group they reach SDPA as they
    are (views of the QKV output, or the rotated key)."""
    return D.ap != D.gp


def _native_gqa(D: Dims) -> bool:
    """``models.layers.native_gqa``: CUDA's flash kernel (half precision) without a window mask
    takes the grouped keys and values as they are (``enable_gqa``), no repeated copies."""
    return D.device != "cpu" and D.backend == "flash" and D.window is None


def _lse(D: Dims) -> int:
    s = -(-D.s // 32) * 32 if D.backend == "efficient" else D.s
    return FP32 * D.b * D.ap * s


Storage = Tuple[str, int]  # a tensor storage by name (each counted once), and its bytes


def _qk_path(D: Dims) -> Tuple[Dict[str, int], Storage, Storage, Storage]:
    """What the split, the q/k norms and RoPE keep, and the storages q, k and v reach the core in.

    q is a view of the QKV output or a regrouped copy (:func:`_query_is_view`); k and v are views.
    A q/k norm (``Norm`` per head on ``F.rms_norm``'s decomposition, or ``HeadsRMSNorm`` over all
    heads) keeps its input (itself in fp32, an fp32 copy in half precision), the rsqrt (per head
    and token, or per token), the fp32 normalised product and, over all heads in half precision, an
    fp32 copy of its scale; its output, or RoPE's rotated copy of it, is what the core sees."""
    qkv: Storage = ("qkv", _qkv_out(D))
    q: Storage = qkv if _query_is_view(D) else ("q_regrouped", _heads(D))
    k = v = qkv
    kept: Dict[str, int] = {}
    if D.qk_norm:
        for tag, src, heads in (("q", q, D.ap), ("k", k, D.gp)):
            size = D.T * heads * D.d
            if D.half:
                kept[f"{tag}_fp32"] = 4 * size
            else:
                kept[src[0]] = src[1]
            kept[f"{tag}_rsqrt"] = 4 * D.T * (heads if D.qk_norm == "head" else 1)
            kept[f"{tag}_product"] = 4 * size
            if D.half and D.qk_norm == "all":  # HeadsRMSNorm's fp32 copy of its half-precision scale
                kept[f"{tag}_scale_fp32"] = 4 * heads * D.d
        q, k = ("q_normed", _heads(D)), ("k_normed", D.E * D.T * D.gp * D.d)
    if D.rope:
        q, k = ("q_rotated", _heads(D)), ("k_rotated", D.E * D.T * D.gp * D.d)
    return kept, q, k, v


def _kernel(D: Dims, q: Storage, k: Storage, v: Storage) -> Dict[str, int]:
    """What the attention kernel saves (q, k, v included) and the projection's copy of its output.

    Flash/efficient SDPA: q, the keys and values (copies after ``repeat_interleave`` with
    grouped-query attention, except CUDA's flash kernel without a mask: :func:`_native_gqa`), the
    output and the fp32 log-sum-exp; a window's mask is shared by the chunk (:func:`shared_bytes`);
    CPU's flash output regroups as a view (:func:`_proj_copies`).
    Math SDPA: the scaled query and key copies, the value, the softmax, and with dropout its mask
    and the dropped probabilities ``b ap s^2 (E + M)`` (the ``5 a s^2 b`` term of Korthikanti et
    al. exists only here), and the projection's regrouped copy.  The blockwise kernel (soft-capped
    scores) and ring attention: q, k, v as given (not repeated), the output, the fp32 log-sum-exp
    and the projection's regrouped copy of the ``[b, ap, s, d]`` output."""
    out: Dict[str, int] = {}
    if D.backend == "math":
        probs = D.b * D.ap * D.s * D.s
        out.update(scaled_q=_heads(D), scaled_k=_heads(D), probs=probs * D.E, proj_copy=_heads(D))
        if D.attention_dropout:
            out["dropped"] = probs * (D.E + D.M)
        out.update([("v_repeated", _heads(D)) if _grouped(D) else v])
        return out
    out.update([q], out=_heads(D), lse=_lse(D))
    if D.backend in ("blockwise", "ring"):
        out.update([k, v], proj_copy=_heads(D))
        return out
    if _grouped(D) and not _native_gqa(D):
        out.update(k_repeated=_heads(D), v_repeated=_heads(D))
    else:
        out.update([k, v])
    if _proj_copies(D):
        out["proj_copy"] = _heads(D)
    return out


def _ulysses(D: Dims) -> int:
    """Ulysses saves, inside its kernel, the all-to-all'ed q, k, v (keys and values repeated to the
    query heads when the groups do not divide by CP), its output and log-sum-exp, all of the same
    size as this rank's share, plus the projection's copy; the QKV output and rotated q/k are not
    saved by anything (q/k norms keep what :func:`_qk_path` says)."""
    groups = D.gp if D.gp % D.cp == 0 else D.ap
    return D.E * D.T * (D.ap + 2 * groups) * D.d + 2 * _heads(D) + _lse(D)


def core_bytes(D: Dims) -> int:
    """What the attention core (``split_qkv``, the q/k norms, RoPE, the kernel) and the output
    projection's input keep: the union of :func:`_qk_path`'s and :func:`_kernel`'s storages, each
    once (the QKV output, say, is kept by the value, the key and the norms alike).  Multi-latent
    attention: :func:`megazero_models.mla_saved.core_bytes`."""
    if D.mla:
        return mla_saved.core_bytes(D)
    kept, q, k, v = _qk_path(D)
    if D.backend == "ulysses":
        return sum(kept.values()) + _ulysses(D)
    return sum({**kept, **_kernel(D, q, k, v)}.values()) + chunk_mask_bytes(D) + FP32 * D.s * D.temperature


def chunk_mask_bytes(D: Dims) -> int:
    """A chunked layer's own additive mask (``--attention-chunk-size``, added to the window's or the
    documents' mask), kept by SDPA's flash/efficient kernels: ``E s^2`` (``E b s^2`` with documents)."""
    if not D.chunk or D.backend not in ("flash", "efficient"):
        return 0
    return D.E * D.s * D.s * (D.b if D.documents else 1)


def _proj_copies(D: Dims) -> bool:
    """Whether the output projection keeps its own regrouped copy of the SDPA output.  CPU's flash
    kernel lays its output out like the query, which ``split_qkv`` leaves seq-major (a view of the
    QKV output, a ``[s, b, heads, d]`` copy permuted, or rotated or normalised from either:
    elementwise ops keep the layout), so the ``[s, b, heads * d]`` regrouping is a view; but a
    per-head q norm (``F.rms_norm``) returns a ``[b, heads, s, d]``-contiguous query, and so output.
    CUDA's kernels write a fresh ``[b, s, heads, d]``-strided output (assumed to need a copy, as
    before; not measured here)."""
    return D.device != "cpu" or D.qk_norm == "head"


def selective_kept(D: Dims) -> int:
    """The recomputed core's saved inputs (q, k, v, with what the q/k norms keep) and its output,
    kept by the projection."""
    if D.mla:
        return mla_saved.selective_kept(D)
    kept, q, k, v = _qk_path(D)
    return sum({**kept, **dict([q, k, v])}.values()) + _heads(D)  # the output (or its copy)


def selective_replay(D: Dims) -> int:
    """Bytes the core's replay saves in backward, beyond its inputs (already kept): the kernel's
    set without q, k, v and without the projection's copy (the output the projection keeps is the
    forward's)."""
    if D.mla:
        return mla_saved.selective_replay(D)
    if D.backend == "ulysses":  # its own q, k, v, output and log-sum-exp
        return _ulysses(D) - _heads(D)
    _, q, k, v = _qk_path(D)
    saved = _kernel(D, q, k, v)
    for name in (q[0], k[0], v[0], "proj_copy"):
        saved.pop(name, None)
    return sum(saved.values())


def rope_bytes(D: Dims) -> int:
    """fp32 cos and sin ``[s, d]`` (once per chunk forward; MLA: of its rotary part)."""
    return 2 * FP32 * D.s * (D.mla.dr if D.mla else D.d) if D.rope else 0


def mlp_bytes(D: Dims) -> int:
    inputs = D.E * D.T * D.h * (2 if (D.sp and D.swiglu) else 1)
    return inputs + D.E * D.T * D.fp * ((4 + D.glu_extra) if D.swiglu else 2)


def _moe_x_bytes(D: Dims) -> int:
    """The MoE layer's input ``x`` itself (``E Tl h``) when something keeps it beyond the shared
    expert's first product (which :func:`mlp_bytes` counts, and at TP 1 is ``x`` itself): the router's
    fp32 product (``x`` in fp32; in half precision fp32 copies of ``x`` and of the router's weight,
    ``4 Tl h + 4 E h``) and the shared gate."""
    M = D.moe
    shared_keeps = M.shared_fp and D.tp == 1
    router = FP32 * (D.Tl + M.experts) * D.h if D.half else 0
    kept_by_others = (not D.half) or M.gate
    return router + (D.E * D.Tl * D.h if kept_by_others and not shared_keeps else 0)


def router_bytes(D: Dims) -> int:
    """What the router keeps for ``t`` tokens over ``E`` experts, top ``k`` (fp32 scores): the top-k
    indices ``8 t k``; softmax after the top-k its ``4 t k`` output, before it (``pre_softmax``) its
    ``4 t E`` output; sigmoid its ``4 t E`` output and, with ``k > 1``, the normalisation's numerator
    and denominator ``4 t (k + 1)``; a capacity's kept-pairs mask ``t E`` (bool); the z-loss's
    logits and log-sum-exp ``4 t (E + 1)``; the load-balancing loss's softmax ``4 t E`` (sigmoid: its
    output and the normaliser, ``4 t (E + 1)``) and the token counts (``4 E``, per sequence ``4 b E``);
    its own top-k is freed with its unused values."""
    M = D.moe
    t, e, k = M.tokens, M.experts, M.topk
    out = 8 * t * k
    if M.score == "sigmoid":
        out += FP32 * t * e + (FP32 * t * (k + 1) if k > 1 else 0)
    else:
        out += FP32 * t * (e if M.pre_softmax else k)
    if M.capacity:
        out += t * e
    if M.z_loss:
        out += FP32 * t * (e + 1)
    if M.aux:
        out += FP32 * t * e + (FP32 * t if M.score == "sigmoid" else 0)
        out += FP32 * e * (D.b if M.aux == "seq_aux_loss" else 1)
    return out


def moe_bytes(D: Dims) -> int:
    """An MoE layer in place of the MLP (:mod:`megazero_models.moe`), balanced routing
    (:class:`megazero.planning.activations.MoEDims`: ``P`` pairs, ``R`` expert rows): the input
    (:func:`_moe_x_bytes`), the router (:func:`router_bytes`), the pairs' expert and token indices
    ``16 P``; the experts' input rows ``E R h`` (regrouped by expert: one copy, which every matrix of
    the grouped product reads), SwiGLU/GeGLU's gate output, activation, first product and product
    ``4 E R fe`` (GELU: its input and output ``2 E R fe``), the index of each bias's rows ``8 R``;
    the combine's fp32 weights ``4 P``, expert outputs ``4 P h`` and weighted outputs ``4 P h`` (with
    ``--moe-apply-probs-on-input`` the weighted input rows ``4 P h`` in place of the expert outputs, and
    the combine's 0/1 weights ``4 P`` beside the routing weights); the
    shared expert (:func:`mlp_bytes` at its size) and its gate's sigmoid ``E Tl`` and the shared
    output it scales ``E Tl h``.  Unequal expert loads cost more: the padded ``bmm`` pads every
    expert to the longest (:func:`megazero.moe.experts.grouped_product`)."""
    M = D.moe
    P, R = M.pairs, M.rows
    experts = D.E * R * D.h + D.E * R * M.fe * (4 if D.swiglu else 2)
    if M.bias:
        experts += 8 * R * (3 if D.swiglu else 2)
    combine = FP32 * P * (1 + 2 * D.h) + (FP32 * P if M.probs_on_input else 0)
    shared = 0
    if M.shared_fp:
        shared = mlp_bytes(replace(D, fp=M.shared_fp))
        if M.gate:
            shared += D.E * D.Tl * (1 + D.h)
    return _moe_x_bytes(D) + router_bytes(D) + 16 * P + experts + combine + shared


def ffn_bytes(D: Dims) -> int:
    """The layer's MLP, or its MoE layer."""
    return moe_bytes(D) if D.moe is not None else mlp_bytes(D)


def _norms_around(D: Dims) -> Tuple[int, int]:
    """Norms of each sublayer's half of a layer: before it (pre, sandwich), after it (post, sandwich)."""
    return int(D.norms != "post"), int(D.norms != "pre")


def _attention_input(D: Dims) -> int:
    """What the attention's input projections keep of their input: the QKV projection ``E T h`` (the
    gathered copy under sequence parallelism); MLA's projections
    (:func:`megazero_models.mla_saved.input_bytes`)."""
    return mla_saved.input_bytes(D) if D.mla else D.E * D.T * D.h


def gate_bytes(D: Dims) -> int:
    """``--attention-output-gate``: the sigmoid's output and the gated product the projection keeps
    (``2 E T ap d``; the ungated output is kept by the product instead), and under sequence
    parallelism the gate's own gathered copy of its input ``E T h``."""
    if not D.out_gate:
        return 0
    return 2 * _heads(D) + (D.E * D.T * D.h if D.sp else 0)


def _attention_half(D: Dims, selective: bool) -> Dict[str, int]:
    """The attention sublayer (or the recurrent mixer in its place) without norms and dropout."""
    if D.ssm is not None:
        if selective:
            return {"mixer": ssm_saved.selective_kept(D)}
        return {"mixer": ssm_saved.mixer_bytes(D)}
    attn = selective_kept(D) if selective else core_bytes(D)
    return {"qkv_input": _attention_input(D), "attention": attn + gate_bytes(D)}


def layer_parts(D: Dims, selective: bool = False) -> Dict[str, int]:
    """One transformer layer's kept bytes by part (module docstring); a hybrid stack's layer
    (``D.kind``) holds one norm, one sublayer and one dropout."""
    if D.kind:
        half = {"mlp": ffn_bytes(D)} if D.kind in (MLP_KIND, MOE_KIND) else _attention_half(D, selective)
        return {"norms": norm_bytes(D), **half, "dropout": dropout_bytes(D)}
    return {"norms": 2 * sum(_norms_around(D)) * norm_bytes(D), **_attention_half(D, selective),
            "mlp": ffn_bytes(D), "dropout": 2 * dropout_bytes(D)}


def layer_bytes(D: Dims, selective: bool = False) -> int:
    return sum(layer_parts(D, selective).values())


def _attention_segment(D: Dims, selective: bool, norms: int) -> Segment:
    """The attention half (or the recurrent mixer in its place) as one segment; under selective
    recomputation backward reaches the core's replay after the dropout mask and the projection's
    input (with the output gate: its sigmoid, product and gathered input too) are freed."""
    kept = norms + sum(_attention_half(D, selective).values()) + dropout_bytes(D)
    if not selective:
        return Segment(kept)
    if D.ssm is not None:
        return Segment(kept, ssm_saved.replay_bytes(D), dropout_bytes(D) + D.E * D.T * D.ssm.d)
    proj_input = mla_saved.proj_input_bytes(D) if D.mla else _heads(D)
    return Segment(kept, selective_replay(D), dropout_bytes(D) + proj_input + gate_bytes(D))


def layer_segments(D: Dims, selective: bool) -> List[Segment]:
    """A layer as two segments (attention half, MLP half) in forward order; a hybrid stack's layer as one."""
    if D.kind in (MLP_KIND, MOE_KIND):
        return [Segment(norm_bytes(D) + ffn_bytes(D) + dropout_bytes(D))]
    if D.kind:
        return [_attention_segment(D, selective, norm_bytes(D))]
    norms = sum(_norms_around(D)) * norm_bytes(D)
    return [_attention_segment(D, selective, norms), Segment(norms + ffn_bytes(D) + dropout_bytes(D))]


def shared_bytes(Ds: Sequence[Dims]) -> int:
    """What a chunk's forward builds once for its layers ``Ds`` and their kernels keep: the RoPE
    tables (when a layer rotates) and one additive window mask ``E s^2`` per window that SDPA's
    flash/efficient kernels take (the math path keeps no mask); with packed documents
    (``--reset-attention-mask``) one ``[b, 1, s, s]`` mask ``E b s^2`` per distinct window (none
    included) instead, which holds the window too."""
    if not Ds:
        return 0
    D = Ds[0]
    rotating = [x for x in Ds if x.rope]  # a hybrid chunk's first layer may be a recurrent one
    rope = rope_bytes(rotating[0]) * (2 if D.local_rope else 1) if rotating else 0  # Gemma 3: two tables
    # a chunked layer keeps its own mask (the shared one plus its chunks: chunk_mask_bytes), not the shared
    kept = [x for x in Ds if x.backend in ("flash", "efficient") and not x.chunk]
    if any(x.documents for x in kept):
        return rope + len({x.window for x in kept}) * D.E * D.b * D.s * D.s
    windows = {x.window for x in kept if x.window is not None}
    return rope + len(windows) * D.E * D.s * D.s


def group_segment(Ds: Sequence[Dims]) -> Segment:
    """Full recomputation of layers ``Ds``: keeps the group's input; the replay holds the layers'
    activations and the chunk's shared tables.  The input's storage is what the first layer's first
    norm keeps (counted once), except RMSNorm in half precision (an fp32 copy); without a norm
    before attention (``post``), the QKV projection keeps the input itself unless sequence
    parallelism gathers it into a copy."""
    D = Ds[0]
    inp = D.E * D.Tl * D.h
    shared = not D.sp if D.norms == "post" else not (D.rms and D.half)
    replay = sum(layer_bytes(x) for x in Ds) + shared_bytes(Ds) - (inp if shared else 0)
    return Segment(inp, replay)


# ---- ends of the model -------------------------------------------------------------------------
def embedding_bytes(D: Dims) -> int:
    """The token ids (TP > 1: the shifted ids and the out-of-range mask), Gemma's scale (a 0-dim
    tensor the multiply keeps) and the dropout mask."""
    ids = 8 * D.T if D.tp == 1 else 8 * D.T + D.T
    return ids + (D.E if D.embed_scale else 0) + dropout_bytes(D)


def head_bytes(D: Dims) -> int:
    """Final norm, head input, cross-entropy, and the executor's masked mean.  Cross-entropy
    (``megazero.tensor_parallel.cross_entropy``): at TP 1 ``F.cross_entropy`` on the unpadded
    columns keeps its fp32 log-softmax ``4 T V``, the labels ``8 T`` and the fp32 total weight (a
    scalar, ``4``); at TP > 1 the vocab-parallel kernel keeps its fp32 softmax ``4 T Vp``, the
    clamped local indices ``8 T`` and the ownership mask ``T``."""
    if D.tp == 1:
        ce = FP32 * D.T * D.v + 8 * D.T + FP32
    else:
        ce = FP32 * D.T * D.vp + 8 * D.T + D.T
    softcap = D.E * D.T * D.vp if D.final_softcap else 0  # tanh keeps its output
    masked_mean = FP32 * D.T * D.cp + FP32  # the masked mean: the whole sequence
    return norm_bytes(D) + D.E * D.T * D.h + softcap + ce + masked_mean


def chunk_params(cfg, pp_rank: int):
    """Each of stage ``pp_rank``'s chunks' parameters as the optimizer holds them
    (:class:`megazero.planning.model_state.ParamSpec`), read off this package's model built on the meta
    device (:func:`megazero.planning.model_state.provider_params`): the estimator's parameter list is the
    model's own."""
    from megazero.planning.model_state import provider_params
    from . import build_chunks
    return provider_params(cfg, pp_rank, build_chunks)
