"""Activation bytes that autograd keeps for backward, per rank, over the pipeline schedule.

What each part of the model saves is declared by the model (for megazero's GPT,
:mod:`megazero_models.saved_activations`) and passed in as ``saved``: an object with
``embedding_bytes(D)``, ``layer_segments(D, selective)`` and ``head_bytes(D)`` of a :class:`Dims`,
``group_segment(Ds)`` and ``shared_bytes(Ds)`` of a list of per-layer Dims (:func:`layer_dims`: a
recomputed group's layers, a chunk's layers sharing RoPE tables and window masks), per
micro-batch, on one rank, in
:class:`Segment` s where backward frees in steps.  Notation: ``s`` sequence, ``b`` micro-batch,
``h`` hidden, ``T = s*b`` tokens (``s``: a CP rank's ``seq / cp`` under context parallelism),
``Tl`` the tokens a rank holds outside the tensor-parallel regions (``T / tp`` under sequence
parallelism, else ``T``), ``ap = heads / tp`` and
``gp = query_groups / tp`` heads per rank of ``d`` channels, ``fp = ffn / tp``, ``Vp`` the padded
vocabulary per TP rank, ``E`` bytes of the compute dtype (4 fp32, 2 bf16/fp16), ``M`` bytes of a
dropout mask element (``E`` on CPU, where dropout multiplies by a mask of the input's dtype; 1 on
CUDA, whose fused dropout keeps a bool mask).

Recomputation: ``full`` keeps only each recomputed group's input ``E Tl h``; during backward the
group is replayed and holds one group's activations at a time.  ``selective`` keeps the attention
core's inputs (the QKV output storage, plus the rotated query/key with RoPE, plus the regrouped
query with grouped-query attention when that is a copy) instead of the SDPA's saved set, and
replays one layer's core in backward.

A chunk is a list of :class:`Segment` s in forward order; its backward frees them in reverse, a
recomputed segment first adding its replay.  :func:`stage_activation_peak` walks the pipeline
schedule's actions (:mod:`megazero.pipeline.schedules`) over those per-chunk figures, so the
in-flight micro-batches of 1F1B, interleaved 1F1B or GPipe are counted as they occur.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, NamedTuple, Optional

from megazero.offload.element_bytes import compute_bytes
from megazero.config.hybrid import (ATTENTION, DELTANET, MAMBA, MAMBA_CONV_KERNEL, layer_kind,
                                    linear_attention_layers, mamba_num_heads)
from megazero.config.patterns import (GATED, active_window, layer_uses_rope, layer_window, uses_rope,
                                      windowed_layers)
from megazero.moe.routing import expert_capacity
from megazero.moe.settings import moe_layers
from megazero.pipeline.partition import chunk_layers
from megazero.pipeline.schedules import interleaved_warmup


@dataclass(frozen=True)
class MoEDims:
    """An MoE layer's sizes on one rank (:func:`moe_dims`).  ``tokens``: the tokens this rank routes
    (``Tl``); ``pairs``: its routed token-expert pairs (with ``--moe-pad-expert-input-to-capacity`` the
    fillers too), ``rows``: the rows its experts run (``pairs`` gathered over expert TP); both assume
    balanced routing (every expert the same number of tokens), which capacity with padding makes
    exact and a dropless router only approaches."""
    experts: int
    topk: int
    local: int           # experts on this rank (num_experts / EP)
    fe: int              # --moe-ffn-hidden-size / expert TP
    shared_fp: int       # the shared expert's hidden size / TP (0: none)
    gate: bool           # --moe-shared-expert-gate
    score: str           # softmax or sigmoid
    pre_softmax: bool
    z_loss: bool
    aux: str             # "aux_loss", "seq_aux_loss" or "" (not computed)
    capacity: bool       # --moe-expert-capacity-factor given (the kept-pairs mask is saved)
    bias: bool           # expert biases
    tokens: int
    pairs: int
    rows: int
    probs_on_input: bool = False  # --moe-apply-probs-on-input (the combine keeps its own weights too)


@dataclass(frozen=True)
class MLADims:
    """A multi-latent attention layer's sizes (``models/mla.py``): the latent ranks (``rq`` 0 without
    --q-lora-rank), the head sizes and whether the latents are normalised (--qk-layernorm)."""
    rq: int
    rkv: int
    dn: int
    dr: int
    dv: int
    norm: bool


@dataclass(frozen=True)
class SSMDims:
    """A recurrent mixer's sizes on one rank (``models/ssm_saved.py``): ``kind`` ``M`` (Mamba-2) or ``G``
    (Gated DeltaNet); ``heads`` (value heads), ``head_dim`` (``p``, or ``dv``), ``state`` (``n``, or the
    key head dim ``dk``), ``groups`` (B/C groups, or key heads), the conv's ``ch`` channels, the
    in-projection's ``F`` features, the ``d`` inner channels, the scan's ``chunk`` and the conv ``kernel``."""
    kind: str
    heads: int
    head_dim: int
    state: int
    groups: int
    ch: int
    F: int
    d: int
    chunk: int
    kernel: int


@dataclass(frozen=True)
class Dims:
    """Per-rank sizes and the kernels that decide what is saved (see the module docstring)."""
    s: int
    b: int
    h: int
    tp: int
    sp: bool
    E: int
    M: int
    ap: int
    gp: int
    d: int
    fp: int
    vp: int
    v: int        # the unpadded vocabulary (TP 1's cross-entropy sees only these columns)
    rope: bool    # this layer rotates queries and keys (RoPE/YaRN, not a --no-rope-freq layer)
    rms: bool
    swiglu: bool  # a gated MLP (SwiGLU or GeGLU: the same saved set)
    half: bool
    hidden_dropout: bool
    attention_dropout: bool
    backend: str  # "flash", "efficient", "math", "blockwise" (soft-capped), "ring" / "ulysses" (CP)
    device: str   # "cpu" or "cuda"
    cp: int = 1   # context-parallel size: ``s`` is then this CP rank's share of the sequence
    window: Optional[int] = None  # this layer's sliding window when it hides keys (SDPA: an additive mask)
    qk_norm: str = ""             # "head" or "all" with --qk-layernorm
    norms: str = "pre"            # --norm-position: pre, post or sandwich
    embed_scale: bool = False     # Gemma's sqrt(h) (a 0-dim tensor the multiply keeps)
    final_softcap: bool = False   # the head's tanh keeps its output
    moe: Optional[MoEDims] = None  # this layer is an MoE layer (:func:`layer_dims`)
    mla: Optional[MLADims] = None  # multi-latent attention (--multi-latent-attention)
    documents: bool = False  # --reset-attention-mask: SDPA takes a [b, 1, s, s] mask per distinct window
    chunk: bool = False      # --attention-chunk-size hides keys of this layer: SDPA takes its own mask
    local_rope: bool = False  # --rotary-base-local: the chunk's second pair of RoPE tables
    temperature: bool = False  # --attn-temperature-tuning on this (NoPE) layer: the query scale [s] it keeps
    glu_extra: int = 0        # MLP intermediates beyond SwiGLU's: quick-GeGLU 1, the GLU clamp 2
    kind: str = ""            # a hybrid stack's layer kind (M, *, -, E, G); "" a transformer layer
    ssm: Optional[SSMDims] = None  # a Mamba-2 / Gated DeltaNet mixer (M, G, --linear-attention-freq)
    out_gate: bool = False    # --attention-output-gate on this attention layer

    @property
    def T(self) -> int:
        return self.s * self.b

    @property
    def Tl(self) -> int:
        return self.T // self.tp if self.sp else self.T


def sdpa_backend(device: str, half: bool, dropout: bool, head_dim: int) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for our call (causal, no mask): CPU runs
    its flash kernel unless attention dropout is on (then the math path); CUDA runs flash for
    16-bit inputs with head dim <= 256, else the memory-efficient kernel."""
    if device == "cpu":
        return "math" if dropout else "flash"
    return "flash" if half and head_dim <= 256 else "efficient"


def dims(cfg, device: str = "cuda", attention: str = "flash") -> Dims:
    """:class:`Dims` of a validated config on ``device`` ("cpu" or "cuda").  ``attention``: the
    kernel of the stack being modelled; ``flash`` is the SDPA kernel megazero runs
    (:func:`sdpa_backend`), ``unfused`` the unfused attention of older Megatron-LM stacks
    (``--attention-backend unfused``/``local``), which keeps the ``s x s`` scores as the math
    kernel does."""
    m, par, pre = cfg.model, cfg.parallel, cfg.precision
    tp = par.tensor_model_parallel_size
    half = bool(pre.bf16 or pre.fp16)
    E = compute_bytes(pre)
    cp = par.context_parallel_size
    mla = (MLADims(rq=m.q_lora_rank or 0, rkv=m.kv_lora_rank, dn=m.qk_head_dim, dr=m.qk_pos_emb_head_dim,
                   dv=m.v_head_dim, norm=bool(m.qk_layernorm)) if m.multi_latent_attention else None)
    head_dim = max(mla.dn + mla.dr, mla.dv) if mla else m.kv_channels
    backend = sdpa_backend(device, half, m.attention_dropout > 0, head_dim)
    if attention == "unfused":
        backend = "math"
    if m.attn_logit_softcapping is not None:
        backend = "blockwise"
    if cp > 1:
        backend = "ring" if par.cp_comm_type == "p2p" else "ulysses"
    return Dims(s=m.seq_length // cp, b=cfg.training.micro_batch_size, h=m.hidden_size, tp=tp,
                sp=bool(par.sequence_parallel), E=E, M=E if device == "cpu" else 1,
                ap=m.num_attention_heads // tp, gp=m.num_query_groups // tp, d=m.kv_channels,
                fp=m.ffn_hidden_size // tp, vp=m.padded_vocab_size // tp, v=m.vocab_size,
                rope=uses_rope(m) or m.multi_latent_attention, rms=m.normalization == "RMSNorm",
                swiglu=m.activation in GATED, half=half, hidden_dropout=m.hidden_dropout > 0,
                glu_extra=(m.activation == "quick_geglu") + 2 * (m.activation_func_clamp_value is not None),
                attention_dropout=m.attention_dropout > 0,
                backend=backend, device=device, cp=cp, qk_norm=m.qk_layernorm_scope if m.qk_layernorm else "",
                norms=m.norm_position, embed_scale=m.scale_embedding,
                final_softcap=m.final_logit_softcapping is not None, mla=mla,
                documents=bool(cfg.data.reset_attention_mask) and backend in ("flash", "efficient", "math"))


def layer_dims(cfg, D: Dims, layer: int) -> Dims:
    """``D`` for transformer layer ``layer``: its RoPE (``--no-rope-freq``) and its window, when the
    window hides keys of a ``--seq-length`` sequence and SDPA takes it as a mask (not under context
    parallelism or soft-capping, whose kernel applies it by position)."""
    m = cfg.model
    window = active_window(layer_window(m, layer), m.seq_length)
    mask = window if D.backend in ("flash", "efficient", "math") else None
    moe = moe_dims(cfg, D) if layer in moe_layers(cfg) else None
    rope = layer_uses_rope(m, layer) or m.multi_latent_attention  # MLA rotates its rotary part always
    chunk = rope and m.attention_chunk_size is not None and m.attention_chunk_size < D.s and \
        D.backend in ("flash", "efficient", "math")
    local = m.rotary_base_local is not None and any(windowed_layers(m))
    temperature = m.attn_temperature_tuning and not layer_uses_rope(m, layer)
    out = replace(D, rope=rope, window=mask, moe=moe, chunk=chunk, local_rope=local, temperature=temperature,
                  out_gate=bool(getattr(m, "attention_output_gate", False)))
    return recurrent_layer_dims(cfg, out, layer)


def recurrent_layer_dims(cfg, D: Dims, layer: int) -> Dims:
    """``D`` of a hybrid stack's layer (``kind``: its pattern symbol; an ``M`` or ``G`` layer's mixer
    sizes, no RoPE, window or gate) or of a transformer layer whose attention is Gated DeltaNet
    (``--linear-attention-freq``)."""
    m = cfg.model
    kind = layer_kind(m, layer) or ""
    linear = linear_attention_layers(m)
    if kind == MAMBA or kind == DELTANET or (linear is not None and linear[layer]):
        return replace(D, kind=kind, ssm=ssm_dims(cfg, MAMBA if kind == MAMBA else DELTANET, D.tp),
                       rope=False, window=None, chunk=False, temperature=False, out_gate=False)
    if kind and kind != ATTENTION:  # an MLP or MoE layer: no attention
        return replace(D, kind=kind, rope=False, window=None, chunk=False, temperature=False, out_gate=False)
    return replace(D, kind=kind)


def ssm_dims(cfg, kind: str, tp: int) -> SSMDims:
    """:class:`SSMDims` of a Mamba-2 (``M``) or Gated DeltaNet (``G``) mixer on one of ``tp`` ranks."""
    m = cfg.model
    if kind == MAMBA:
        H, g, p, n = mamba_num_heads(m) // tp, m.mamba_num_groups // tp, m.mamba_head_dim, m.mamba_state_dim
        r = H // g
        return SSMDims(kind, H, p, n, g, ch=H * p + 2 * g * n, F=g * (2 * r * p + 2 * n + r), d=H * p,
                       chunk=m.mamba_chunk_size, kernel=MAMBA_CONV_KERNEL)
    H, g = m.linear_num_value_heads // tp, m.linear_num_key_heads // tp
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    r = H // g
    return SSMDims(kind, H, dv, dk, g, ch=2 * g * dk + H * dv, F=g * (2 * dk + 2 * r * dv + 2 * r), d=H * dv,
                   chunk=m.linear_chunk_size, kernel=m.linear_conv_kernel_dim)


def mtp_layer_dims(cfg, D: Dims) -> Dims:
    """``D`` for a multi-token prediction layer: rotated (windows and NoPE layers are refused with MTP),
    an MoE layer when the last decoder layer is one."""
    from megazero.moe.settings import mtp_moe_layers
    m = cfg.model
    moe = moe_dims(cfg, D) if mtp_moe_layers(cfg) else None
    return replace(D, rope=uses_rope(m) or m.multi_latent_attention, window=None, moe=moe)


def moe_dims(cfg, D: Dims) -> MoEDims:
    """:class:`MoEDims` of an MoE layer.  Balanced routing: this rank's ``Tl`` tokens make ``Tl k``
    pairs (dropless); with a capacity ``C = ceil(factor k T_mb / E)`` over the micro-batch's ``T_mb``
    tokens (split over ``tp x cp`` under sequence parallelism, ``cp`` otherwise) each expert keeps at
    most ``C`` of them (exactly ``C`` with padding), this rank's share ``1 / split`` of that.  The
    all-to-all brings each rank's experts as many rows as it sends (balanced), expert TP gathers them
    from its ``etp`` ranks."""
    moe, par = cfg.moe, cfg.parallel
    k, e = moe.moe_router_topk, moe.num_experts
    split = par.context_parallel_size * (D.tp if D.sp else 1)
    pairs = D.Tl * k
    if moe.moe_expert_capacity_factor is not None:
        cap = expert_capacity(D.Tl * split, e, k, moe.moe_expert_capacity_factor)
        pairs = (e * cap if moe.moe_pad_expert_input_to_capacity else min(pairs * split, e * cap)) // split
    etp = moe.expert_tensor_parallel_size or D.tp
    aux = moe.moe_router_load_balancing_type if moe.moe_aux_loss_coeff else ""
    shared = moe.moe_shared_expert_intermediate_size or 0
    return MoEDims(experts=e, topk=k, local=e // moe.expert_model_parallel_size,
                   fe=moe.moe_ffn_hidden_size // etp, shared_fp=shared // D.tp,
                   gate=bool(shared and moe.moe_shared_expert_gate), score=moe.moe_router_score_function,
                   pre_softmax=bool(moe.moe_router_pre_softmax), z_loss=bool(moe.moe_z_loss_coeff),
                   aux=aux if aux in ("aux_loss", "seq_aux_loss") else "",
                   capacity=moe.moe_expert_capacity_factor is not None, bias=bool(cfg.model.add_bias_linear),
                   tokens=D.Tl, pairs=pairs, rows=pairs * etp,
                   probs_on_input=bool(moe.moe_apply_probs_on_input))


class Segment(NamedTuple):
    """Part of a chunk's forward: ``kept`` bytes until its backward; ``replay`` bytes more while its
    recomputation runs in backward, after ``freed_first`` of its own bytes were already released."""
    kept: int
    replay: int = 0
    freed_first: int = 0


def chunk_segments(cfg, D: Dims, layers: range, pre: bool, post: bool, saved) -> List[Segment]:
    """One chunk's segments in forward order (recomputation as configured); ``layers``: the
    chunk's global layer indices (layers differ in RoPE and window)."""
    m = cfg.model
    selective = m.recompute_granularity == "selective"
    Ds = [layer_dims(cfg, D, i) for i in layers]
    n_layers = len(Ds)
    segs = [Segment(saved.embedding_bytes(D))] if pre else []
    if m.recompute_granularity == "full":
        k = m.recompute_num_layers or 1
        if m.recompute_method == "block":
            recomputed = min(k, n_layers)
            segs += [saved.group_segment(Ds[i:i + 1]) for i in range(recomputed)]
            if n_layers > recomputed:
                segs.append(Segment(saved.shared_bytes(Ds[recomputed:])))
            for Dl in Ds[recomputed:]:
                segs += saved.layer_segments(Dl, False)
        else:
            segs += [saved.group_segment(Ds[i:i + k]) for i in range(0, n_layers, k)]
    else:
        if n_layers:
            segs.append(Segment(saved.shared_bytes(Ds)))
        for Dl in Ds:
            segs += saved.layer_segments(Dl, selective)
    if post:
        segs.append(Segment(saved.head_bytes(D)))
        if m.mtp_num_layers:  # multi-token prediction's depths, after the head's main part
            segs += saved.mtp_segments(D, mtp_layer_dims(cfg, D), m.mtp_num_layers, selective)
    return segs


def chunk_profile(segments: List[Segment]) -> tuple:
    """(kept bytes at the end of the forward, peak during its backward)."""
    kept = sum(s.kept for s in segments)
    live, peak = kept, kept
    for seg in reversed(segments):
        if seg.replay:
            peak = max(peak, live - seg.freed_first + seg.replay)
        live -= seg.kept
    return kept, peak


# ---- a pipeline stage over the schedule --------------------------------------------------------
def stage_chunks(cfg, pp_rank: int, saved, device: str = "cuda", attention: str = "flash") -> List[tuple]:
    """(kept, backward peak) of each of this stage's chunks for one micro-batch."""
    D = dims(cfg, device, attention)
    pp = cfg.parallel.pipeline_model_parallel_size
    ranges = chunk_layers(cfg, pp_rank)
    return [chunk_profile(chunk_segments(cfg, D, r, pp_rank == 0 and v == 0,
                                         pp_rank == pp - 1 and v == len(ranges) - 1, saved))
            for v, r in enumerate(ranges)]


def compute_order(cfg, pp_rank: int) -> List[tuple]:
    """This stage's ``("fwd"|"bwd", chunk)`` compute actions in schedule order (the compute actions
    of :func:`megazero.pipeline.schedules.build_schedule`, without the messages).  For the
    interleaved schedule the live set repeats once the steady state is reached, which ``4 pp``
    micro-batches (a multiple of ``pp``, as it requires) always include, so at most those are
    generated."""
    par = cfg.parallel
    pp, vp, m = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size, \
        cfg.training.num_micro_batches
    if par.pipeline_schedule != "interleaved":
        if par.pipeline_schedule == "gpipe":
            return [("fwd", 0)] * m + [("bwd", 0)] * m
        warm = min(pp - pp_rank - 1, m)
        return [("fwd", 0)] * warm + [("fwd", 0), ("bwd", 0)] * (m - warm) + [("bwd", 0)] * warm
    m = min(m, 4 * pp)
    total, w = m * vp, interleaved_warmup(pp, pp_rank, m, vp)
    chunk = [k % (pp * vp) // pp for k in range(total)]  # Megatron's virtual-step -> chunk rule
    order = [("fwd", c) for c in chunk[:w]]
    for i in range(total - w):
        order += [("fwd", chunk[w + i]), ("bwd", vp - 1 - chunk[i])]
    return order + [("bwd", vp - 1 - c) for c in chunk[total - w:]]


def schedule_peak(cfg, pp_rank: int, per_chunk: List[tuple]) -> int:
    """Peak of ``sum(kept of in-flight chunk forwards)`` over this stage's schedule, a backward
    adding its own excess (``peak - kept``) while it runs.  One chunk (GPipe, 1F1B): ``N`` in
    flight (``m``, or ``min(pp - r, m)``) give ``(N - 1) kept + backward peak``; the interleaved
    schedule is walked action by action."""
    par, tr = cfg.parallel, cfg.training
    pp, m = par.pipeline_model_parallel_size, tr.num_micro_batches
    if len(per_chunk) == 1 and par.pipeline_schedule != "interleaved":
        kept, bwd_peak = per_chunk[0]
        n = m if par.pipeline_schedule == "gpipe" else min(pp - pp_rank, m)
        return max(n * kept, (n - 1) * kept + bwd_peak)
    live = peak = 0
    for kind, chunk in compute_order(cfg, pp_rank):
        kept, bwd_peak = per_chunk[chunk]
        if kind == "fwd":
            live += kept
            peak = max(peak, live)
        else:
            peak = max(peak, live - kept + bwd_peak)
            live -= kept
    return peak


def in_flight(cfg, pp_rank: int) -> int:
    """Most chunk forwards awaiting their backward on stage ``pp_rank`` (from the schedule)."""
    live = most = 0
    for kind, _ in compute_order(cfg, pp_rank):
        live += 1 if kind == "fwd" else -1
        most = max(most, live)
    return most


def stage_activation_peak(cfg, pp_rank: int, saved, device: str = "cuda", attention: str = "flash") -> int:
    """Peak activation bytes kept for backward on one rank of stage ``pp_rank`` (``attention``:
    :func:`dims`)."""
    return schedule_peak(cfg, pp_rank, stage_chunks(cfg, pp_rank, saved, device, attention))
