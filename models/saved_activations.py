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
- the QKV projection keeps its input ``E T h`` (the norm output, or the sequence-gathered copy);
- attention, flash/efficient SDPA (CPU without attention dropout, CUDA): the query storage, the
  key and value after ``repeat_interleave`` (always copies, ``2 E T ap d``), the output
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
- RoPE keeps fp32 ``cos`` and ``sin`` ``2 * 4 s d`` once per chunk forward (shared by its layers);
- each hidden dropout keeps its mask ``M Tl h``;
- the MLP keeps its input ``E T h`` (twice under sequence parallelism with SwiGLU: gate and fc1
  each gather it), GELU its input and output ``2 E T fp``, SwiGLU the gate output, its SiLU, the
  fc1 output and the product ``4 E T fp``.

Embedding (first stage): the token ids ``8 T`` (with TP > 1 the shifted ids ``8 T`` and the
out-of-range mask ``T``), the dropout mask ``M Tl h``.  Head and loss (last stage): the final
norm, the head's input ``E T h``, the cross-entropy's fp32 softmax ``4 T Vp``, shifted labels
``8 T``, ownership mask ``T`` and vocabulary mask ``Vp``; the executor's loss keeps the loss mask
``4 T`` and one fp32 scalar.

"""
from __future__ import annotations

from typing import Dict, List

from megazero.element_bytes import FP32
from megazero.planning.activations import Dims, Segment


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


def _qkv_kept(D: Dims) -> bool:
    """Whether SDPA (or the selective recomputation) saves a view of the QKV output: the query
    without RoPE when it is a view, or the value (and unrotated key) when they are not repeated."""
    return (not D.rope and _query_is_view(D)) or not _grouped(D)


def _query_own(D: Dims) -> int:
    """The query's own storage when it is not a view of the QKV output (rotated, or regrouped)."""
    return 0 if (not D.rope and _query_is_view(D)) else _heads(D)


def _key_own(D: Dims) -> int:
    """Keys and values SDPA saves outside the QKV output: the two repeated copies with
    grouped-query attention, else the rotated key ``E T gp d`` with RoPE (the value is a view)."""
    if _grouped(D):
        return 2 * _heads(D)
    return D.E * D.T * D.gp * D.d if D.rope else 0


def _lse(D: Dims) -> int:
    s = -(-D.s // 32) * 32 if D.backend == "efficient" else D.s
    return FP32 * D.b * D.ap * s


def _math_set(D: Dims) -> int:
    """What the math SDPA saves: the scaled query and key (copies ``2 E T ap d``), the value as
    given (the repeated copy, or a view of the QKV output: counted by the caller), the softmax,
    and with attention dropout its mask and the dropped probabilities ``b ap s^2 (E + M)`` (the
    ``5 a s^2 b`` term of Korthikanti et al. exists only here)."""
    probs = D.b * D.ap * D.s * D.s
    dropped = probs * (D.E + D.M) if D.attention_dropout else 0
    return 2 * _heads(D) + (_heads(D) if _grouped(D) else 0) + probs * D.E + dropped


def _cp_core(D: Dims) -> int:
    """Context parallelism. Ring attention (:mod:`megazero.context_parallel.ring_attention`) saves q, k,
    v as given (keys and values are not repeated: the kernel folds the grouped query heads), its
    output ``E T ap d`` and the fp32 log-sum-exp ``4 b ap s``; the value is a view of the QKV output,
    so that stays; the output is ``[b, ap, s, d]``-contiguous, so the projection keeps a regrouped copy.
    Ulysses saves, inside its kernel, the all-to-all'ed q, k, v (keys and values repeated to the
    query heads when the groups do not divide by CP), its output and log-sum-exp, all of the same
    size as this rank's share, plus the projection's copy; the QKV output and rotated q/k are not
    saved by anything."""
    if D.backend == "ring":
        rotated_key = D.E * D.T * D.gp * D.d if D.rope else 0
        return _qkv_out(D) + _query_own(D) + rotated_key + 2 * _heads(D) + _lse(D)
    groups = D.gp if D.gp % D.cp == 0 else D.ap
    return D.E * D.T * (D.ap + 2 * groups) * D.d + 2 * _heads(D) + _lse(D)


def core_bytes(D: Dims) -> int:
    """What the attention core (``split_qkv``, RoPE, ``repeat_interleave``, SDPA) and the output
    projection's input keep.

    Flash/efficient: the QKV output when a saved query/key/value views it (:func:`_qkv_kept`),
    the query's own storage (:func:`_query_own`), the repeated or rotated keys
    (:func:`_key_own`), the output ``E T ap d``, the fp32 log-sum-exp, and the projection's
    regrouped copy of the output where it is one (:func:`_proj_copies`).  Math: :func:`_math_set`,
    the QKV output when the value is a view of it, and the projection's regrouped copy of the
    ``[b, ap, s, d]`` output ``E T ap d``."""
    if D.cp > 1:
        return _cp_core(D)
    qkv = _qkv_out(D) if _qkv_kept(D) else 0
    if D.backend == "math":
        return _math_set(D) + (qkv if not _grouped(D) else 0) + _heads(D)
    return qkv + _query_own(D) + _key_own(D) + _heads(D) + _lse(D) + (_heads(D) if _proj_copies(D) else 0)


def _proj_copies(D: Dims) -> bool:
    """Whether the output projection keeps its own regrouped copy of the SDPA output.  CPU's flash
    kernel lays its output out like the query, which ``split_qkv`` leaves seq-major (a view of the
    QKV output, a ``[s, b, heads, d]`` copy permuted, or rotated from either: elementwise ops keep
    the layout), so the ``[s, b, heads * d]`` regrouping is a view.  CUDA's kernels write a fresh
    ``[b, s, heads, d]``-strided output (assumed to need a copy, as before; not measured here)."""
    return D.device != "cpu"


def selective_kept(D: Dims) -> int:
    """The recomputed core's saved inputs (q, k, v) and its output, kept by the projection."""
    kept = _qkv_out(D)                       # v (and k, q without RoPE) are views of the QKV output
    if D.rope:
        kept += _heads(D) + D.E * D.T * D.gp * D.d   # rotated q and k
    elif not _query_is_view(D):
        kept += _heads(D)                     # q regrouped to [b, heads, s, d]
    return kept + _heads(D)  # the output the projection keeps (math: its regrouped copy)


def selective_replay(D: Dims) -> int:
    """Bytes the core's replay saves in backward, beyond its inputs (already kept): flash, the
    repeated keys and values (grouped-query attention), the output and the log-sum-exp; math,
    :func:`_math_set` (its output is not saved inside the core)."""
    if D.backend == "math":
        return _math_set(D)
    if D.backend == "ring":  # the output and the log-sum-exp (q, k, v are the kept inputs)
        return _heads(D) + _lse(D)
    if D.backend == "ulysses":  # its own q, k, v, output and log-sum-exp
        return _cp_core(D) - _heads(D)
    return (2 * _heads(D) if _grouped(D) else 0) + _heads(D) + _lse(D)


def rope_bytes(D: Dims) -> int:
    """fp32 cos and sin ``[s, d]`` (once per chunk forward)."""
    return 2 * FP32 * D.s * D.d if D.rope else 0


def mlp_bytes(D: Dims) -> int:
    inputs = D.E * D.T * D.h * (2 if (D.sp and D.swiglu) else 1)
    return inputs + D.E * D.T * D.fp * (4 if D.swiglu else 2)


def layer_parts(D: Dims, selective: bool = False) -> Dict[str, int]:
    """One transformer layer's kept bytes by part (module docstring)."""
    attn = selective_kept(D) if selective else core_bytes(D)
    return {"norms": 2 * norm_bytes(D), "qkv_input": D.E * D.T * D.h, "attention": attn,
            "mlp": mlp_bytes(D), "dropout": 2 * dropout_bytes(D)}


def layer_bytes(D: Dims, selective: bool = False) -> int:
    return sum(layer_parts(D, selective).values())


def layer_segments(D: Dims, selective: bool) -> List[Segment]:
    """A layer as two segments (attention half, MLP half) in forward order."""
    attn = norm_bytes(D) + D.E * D.T * D.h + dropout_bytes(D)
    mlp = norm_bytes(D) + mlp_bytes(D) + dropout_bytes(D)
    if not selective:
        return [Segment(attn + core_bytes(D)), Segment(mlp)]
    # backward reaches the core's replay after the dropout mask and the projection's input are freed
    return [Segment(attn + selective_kept(D), selective_replay(D), dropout_bytes(D) + _heads(D)),
            Segment(mlp)]


def group_segment(D: Dims, n_layers: int) -> Segment:
    """Full recomputation of ``n_layers`` layers: keeps the group's input; the replay holds the
    layers' activations (the input's storage is the first norm's saved input, counted once, except
    RMSNorm in half precision, which saves an fp32 copy)."""
    inp = D.E * D.Tl * D.h
    shared = not (D.rms and D.half)
    replay = n_layers * layer_bytes(D) + rope_bytes(D) - (inp if shared else 0)
    return Segment(inp, replay)


# ---- ends of the model -------------------------------------------------------------------------
def embedding_bytes(D: Dims) -> int:
    ids = 8 * D.T if D.tp == 1 else 8 * D.T + D.T
    return ids + dropout_bytes(D)


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
    masked_mean = FP32 * D.T * D.cp + FP32  # the masked mean: the whole sequence
    return norm_bytes(D) + D.E * D.T * D.h + ce + masked_mean
