"""The time of one micro-batch on a GPU, by shape: what the planner uses for a named GPU type.

Compute, per TP rank, for the slowest pipeline stage:

- **Matmuls** run at ``peak x gemm_max x I / (I + knee x balance)``.  ``I = 2MNK / (E (MN + NK +
  MK))`` is the GEMM's arithmetic intensity (FLOPs per byte of its operands and result, ``E``
  bytes an element) and ``balance = peak / HBM bandwidth`` the GPU's (the roofline's ridge): a
  GEMM far above the ridge approaches ``gemm_max`` of peak, one near it reaches half of that.  So a
  25600-wide layer runs faster per FLOP than a 2304-wide one, and tensor parallelism, which
  narrows every GEMM, costs efficiency as well as communication.  Backward is two GEMMs of the
  same three dimensions (input and weight gradients) per forward GEMM.
- **Attention** ``softmax(QK^T) V`` with a memory-efficient kernel (FlashAttention, SDPA's flash
  path): ``4 s_q s_kv d`` FLOPs a head forward, halved by the causal mask that the kernel skips,
  backward 2.5x forward (it recomputes the scores), at ``attn_eff`` of peak.  A layer with a sliding
  window (``--window-size``) counts the keys its queries see, ``min(i + 1, window + 1)`` for the query
  at position ``i``, instead of the causal ``s / 2`` on average (:func:`causal_keys`, averaged over
  the layers, as :mod:`megazero.planning.flops` does for FLOPs).  The unfused kernel
  of older Megatron-LM releases (``attention="unfused"``) instead runs two batched GEMMs per head
  at the GEMM efficiency of their shape and writes the ``s x s`` scores: scale, mask and softmax
  read and write them once each way, dropout reads, writes and keeps a 1-byte mask (a window only
  masks them: the unfused kernel still computes every score).
- **Element-wise and normalisation** work is bandwidth-bound: per token and layer the forward
  reads and writes 23 hidden-size vectors (two layer norms 2 each, two dropouts 2.5, two residual
  adds 3, bias + GeLU on the 4h-wide MLP 8), the backward twice that, at the HBM bandwidth; under
  sequence parallelism each TP rank does ``1/t`` of it.

An MoE layer (``--num-experts``) runs its router, its local experts' matmuls for the rows the
all-to-all brings them (balanced routing) and its shared expert in place of the MLP
(:func:`moe_layer_gemms`); the all-to-all itself is the planner's (:func:`megazero.planning.planner.ep_time`).

Communication: TP's collectives (two forward and two backward per layer, two more forward under
full recomputation) on the node's link, exposed; CP's ring passes each K/V block (and its
gradient backward) to the next rank, hidden behind the attention it feeds when that is longer.
Pipeline and data-parallel terms are the planner's (:mod:`megazero.planning.planner`).

Every constant of :data:`GPU_TYPES` is documented there with its source; ``gemm_max``,
``knee`` and ``attn_eff`` are fitted by ``scripts/bench_planner.py --published --fit`` on the
published rows marked for fitting (:mod:`megazero.planning.published`), and the other rows are
reported as held out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from megazero.offload.element_bytes import compute_bytes
from megazero.config.patterns import GATED, active_window, layer_window
from megazero.moe.settings import moe_layers
from megazero.pipeline.partition import stage_layer_counts

# Elements per token and layer that element-wise forward work reads and writes (module docstring).
ELEMENTWISE_VECTORS = 23.0
# Scores passes of the unfused attention, in elements of s x s per head: scale/mask/softmax read and
# write (2), dropout reads, writes and keeps a 1-byte mask (2.5); backward reads and writes each again.
UNFUSED_SCORE_PASSES_FWD, UNFUSED_SCORE_PASSES_BWD = 4.5, 6.0


@dataclass(frozen=True)
class Link:
    """``alpha`` seconds per message + ``beta`` seconds per byte."""
    alpha: float
    beta: float

    def p2p(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes

    def ring(self, nbytes: float, n: int, passes: int = 1, messages: int = 1) -> float:
        """A ring collective over ``n`` ranks: ``passes`` = 1 for all-gather / reduce-scatter of a
        ``nbytes`` buffer, 2 for all-reduce; ``messages``: the buffer goes as that many collectives
        (buckets), each paying the latency."""
        if n <= 1:
            return 0.0
        return passes * (n - 1) * (messages * self.alpha + self.beta * nbytes / n)

    def all_reduce(self, nbytes: float, n: int, messages: int = 1) -> float:
        """An all-reduce over ``n`` ranks: the cheaper of a ring and a (double binary) tree, which
        pays ``2 log2 n`` latencies instead of ``2 (n - 1)`` and sends each byte about twice, as NCCL
        picks between them by size and scale."""
        if n <= 1:
            return 0.0
        tree = 2 * (messages * self.alpha * math.ceil(math.log2(n)) + self.beta * nbytes)
        return min(self.ring(nbytes, n, 2, messages), tree)


@dataclass(frozen=True)
class GpuType:
    """One GPU type and its node.  ``*_gbs``: GB/s; ``link_gbs``: per GPU per direction inside
    the node; ``net_gbs``: per GPU between nodes; ``busbw``: the fraction of a link's bandwidth a
    ring collective reaches; ``alpha_*``: seconds per message."""
    name: str
    peak_tflops: float
    memory_gb: float
    hbm_gbs: float
    link_gbs: float
    net_gbs: float
    gemm_max: float
    attn_eff: float
    busbw: float = 0.8
    alpha_intra: float = 5e-6
    alpha_inter: float = 15e-6


# Shared by every type: the GEMM efficiency knee in units of the GPU's roofline ridge (fitted).
KNEE = 0.2211

# Sources: peak dense 16-bit TFLOP/s, memory and HBM bandwidth from NVIDIA's A100 (SXM4 80GB), H100
# (SXM5) and H200 datasheets and the L4 datasheet; NVLink per direction is half the datasheet's
# bidirectional figure (A100 600 GB/s, H100/H200 900 GB/s; the L4 has none: PCIe Gen4 x16 at 32 GB/s,
# half usable each way); the network is one HDR 200 Gb/s (DGX A100) or NDR 400 Gb/s (DGX H100) NIC per
# GPU, 100 Gb/s for L4 servers.  busbw 0.8: an assumption (ring all-reduce bus bandwidth / link).
# gemm_max and the H100's attn_eff: fitted (module docstring; 2026-12 fit: knee 0.2211, A100 0.80, H100
# 0.695 with attn_eff 0.28 from Llama 3's 8k and 128k-token rows).  The H100's attn_eff is an effective
# figure: it also carries what the model leaves out of long-sequence attention at scale (Llama 3's
# context parallelism gathers K/V instead of the ring modelled here).  The A100's attn_eff (0.5) is an
# assumption: its rows ran the unfused kernel.  H200: the H100's compute with the H200's memory,
# unvalidated; L4: the A100's efficiencies, unvalidated.
GPU_TYPES: Dict[str, GpuType] = {
    "A100": GpuType("A100", 312.0, 80.0, 2039.0, 300.0, 25.0, gemm_max=0.80, attn_eff=0.5),
    "H100": GpuType("H100", 989.0, 80.0, 3350.0, 450.0, 50.0, gemm_max=0.695, attn_eff=0.28),
    "H200": GpuType("H200", 989.0, 141.0, 4800.0, 450.0, 50.0, gemm_max=0.695, attn_eff=0.28),
    "L4": GpuType("L4", 121.0, 24.0, 300.0, 16.0, 12.5, gemm_max=0.80, attn_eff=0.5),
}


def gemm_seconds(m: float, n: float, k: float, gpu: GpuType, elem: int = 2, knee: float = KNEE) -> float:
    """Time of one ``m x k`` by ``k x n`` matmul (module docstring)."""
    flops = 2.0 * m * n * k
    intensity = flops / (elem * (m * n + n * k + m * k))
    balance = gpu.peak_tflops * 1e12 / (gpu.hbm_gbs * 1e9)
    eff = gpu.gemm_max * intensity / (intensity + knee * balance)
    return flops / (gpu.peak_tflops * 1e12 * eff)


def attention_gemms(cfg, tokens: int) -> List[Tuple[int, int, int]]:
    """(M, N, K) of one layer's attention projections on one TP rank for ``tokens`` tokens: QKV and the
    output; multi-latent attention's down-projections (replicated: every rank its own tokens, under
    sequence parallelism its part of them), up-projections (or the one query projection) and output."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    h = m.hidden_size
    if getattr(m, "multi_latent_attention", False):
        n, rq, rkv = m.num_attention_heads // t, m.q_lora_rank, m.kv_lora_rank
        dq, dr = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_pos_emb_head_dim
        local = tokens // t if cfg.parallel.sequence_parallel else tokens
        query = [(local, rq, h), (tokens, n * dq, rq)] if rq else [(tokens, n * dq, h)]
        return query + [(local, rkv + dr, h), (tokens, n * (m.qk_head_dim + m.v_head_dim), rkv),
                        (tokens, h, n * m.v_head_dim)]
    kv_ch = m.kv_channels or h // m.num_attention_heads
    q, kv = m.num_attention_heads * kv_ch, (m.num_query_groups or m.num_attention_heads) * kv_ch
    return [(tokens, (q + 2 * kv) // t, h), (tokens, h, q // t)]


def layer_gemms(cfg, tokens: int) -> List[Tuple[int, int, int]]:
    """(M, N, K) of one layer's forward matmuls on one TP rank for ``tokens`` tokens."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    h = m.hidden_size
    ffn = m.ffn_hidden_size or 4 * h
    up = 2 * ffn if m.activation in GATED else ffn
    return attention_gemms(cfg, tokens) + [(tokens, up // t, h), (tokens, h, ffn // t)]


def moe_layer_gemms(cfg, tokens: int) -> List[Tuple[int, int, int]]:
    """(M, N, K) of an MoE layer's forward matmuls on one rank in place of the MLP's, balanced routing:
    the router ``(tokens / tp, E, h)`` under sequence parallelism; each of the ``E / ep`` local experts
    runs ``tokens k ep / E`` rows (all-to-all over EP) times ``etp / tp`` (expert TP gathers its ranks'
    tokens, SP splits them over TP) through its two (gated: three) matrices of ``ffn / etp``; the shared
    expert as a dense MLP split over TP."""
    m, par, moe = cfg.model, cfg.parallel, cfg.moe
    t, h = par.tensor_model_parallel_size, m.hidden_size
    ep, etp, e, k = moe.expert_model_parallel_size, moe.expert_tensor_parallel_size or t, moe.num_experts, \
        moe.moe_router_topk
    glu = 2 if m.activation in GATED else 1
    local_tokens = tokens // t if par.sequence_parallel else tokens
    rows = max(1, tokens * k * ep * etp // (e * t))
    f = moe.moe_ffn_hidden_size // etp
    out = [(local_tokens, e, h)] + [(rows, glu * f, h), (rows, h, f)] * (e // ep)
    shared = moe.moe_shared_expert_intermediate_size
    if shared:
        out += [(tokens, glu * shared // t, h), (tokens, h, shared // t)]
    return out


def layers_gemm_seconds(cfg, tokens: int, gpu: GpuType, elem: int, knee: float) -> float:
    """One layer's matmul seconds, the mean over the layers when MoE and dense layers mix."""
    dense = sum(gemm_seconds(*g, gpu, elem, knee) for g in layer_gemms(cfg, tokens))
    moe = len(moe_layers(cfg))
    if not moe:
        return dense
    attention = sum(gemm_seconds(*g, gpu, elem, knee) for g in attention_gemms(cfg, tokens))
    routed = attention + sum(gemm_seconds(*g, gpu, elem, knee) for g in moe_layer_gemms(cfg, tokens))
    layers = cfg.model.num_layers
    return (dense * (layers - moe) + routed * moe) / layers


def causal_keys(s: int, window=None) -> float:
    """Keys a query sees on average in a causal ``s``-token sequence: ``s / 2`` (the half of the scores
    the causal kernel skips), or with a sliding window of ``window`` keys before the query's own that
    hides some, the exact mean of ``min(i + 1, window + 1)`` over positions ``i``."""
    w = active_window(window, s)
    if w is None:
        return 0.5 * s
    return (w + 1) - (w + 1) * w / (2.0 * s)


def mean_causal_keys(m) -> float:
    """:func:`causal_keys` averaged over the model's layers (windows differ by layer)."""
    return sum(causal_keys(m.seq_length, layer_window(m, i)) for i in range(m.num_layers)) / m.num_layers


def micro_batch_seconds(cfg, gpu: GpuType, knee: float = KNEE, attention: str = "flash") -> Dict[str, float]:
    """Seconds of one micro-batch on the slowest stage: ``fwd`` (forward compute), ``compute``
    (forward + backward + recomputation), ``wgrad`` (the weight gradients' products, part of
    ``compute``), ``tp_comm`` and ``cp_comm`` (exposed), for a validated config, GPU type and
    attention kernel (``flash`` or ``unfused``)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    t, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    cp = par.context_parallel_size
    elem = compute_bytes(cfg.precision)
    s, b, h = m.seq_length, tr.micro_batch_size, m.hidden_size
    tokens = b * s // cp
    heads = m.num_attention_heads // t
    d = m.kv_channels or h // m.num_attention_heads
    if getattr(m, "multi_latent_attention", False):  # the kernel's head size (values padded to the query's)
        d = max(m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim)
    hbm = gpu.hbm_gbs * 1e9
    gemm = layers_gemm_seconds(cfg, tokens, gpu, elem, knee)
    if attention == "unfused":
        bmm = 2 * b * heads * gemm_seconds(s, s, d, gpu, elem, knee)
        scores = b * heads * s * s * elem / hbm
        attn_f, attn_b = bmm + UNFUSED_SCORE_PASSES_FWD * scores, 2 * bmm + UNFUSED_SCORE_PASSES_BWD * scores
    else:
        flops = 4.0 * b * heads * (s // cp) * mean_causal_keys(m) * d
        attn_f = flops / (gpu.peak_tflops * 1e12 * gpu.attn_eff)
        attn_b = 2.5 * attn_f
    spread = t if par.sequence_parallel else 1
    elementwise = ELEMENTWISE_VECTORS * tokens * h * elem / spread / hbm
    layer_f = gemm + attn_f + elementwise
    layer_b = 2 * gemm + attn_b + 2 * elementwise
    recompute = {"full": layer_f, "selective": attn_f}.get(m.recompute_granularity or "none", 0.0)
    vocab = m.padded_vocab_size or m.vocab_size
    head = gemm_seconds(tokens, vocab // t, h, gpu, elem, knee)
    counts = stage_layer_counts(m.num_layers, pp, par.decoder_first_pipeline_num_layers,
                                par.decoder_last_pipeline_num_layers)
    # the slowest stage: one before the last, or the last with the output head
    per_layer = layer_f + layer_b + recompute
    busiest, last = max(counts[:-1], default=0), counts[-1]
    if pp > 1 and busiest * per_layer >= last * per_layer + 3 * head:
        layers, fwd, compute, wgrad = busiest, busiest * layer_f, busiest * per_layer, busiest * gemm
    else:
        layers, fwd, compute = last, last * layer_f + head, last * per_layer + 3 * head
        wgrad = last * gemm + head
    act = tokens * h * elem
    link = Link(gpu.alpha_intra, 1.0 / (gpu.link_gbs * 1e9 * gpu.busbw))
    n_tp = layers * (6 if m.recompute_granularity == "full" else 4) + 1
    tp_comm = n_tp * link.all_reduce(act, t)
    cp_comm = 0.0
    if cp > 1:
        kv = (m.num_query_groups or m.num_attention_heads) * d // t
        block = 2 * tokens * kv * elem  # this rank's K and V
        net = Link(gpu.alpha_inter, 1.0 / (gpu.net_gbs * 1e9 * gpu.busbw)) if cp * t > 8 else link
        step = net.p2p(block)
        passes = 1 + 2 + (1 if m.recompute_granularity == "full" else 0)  # K/V fwd, K/V + dK/dV bwd
        cp_comm = layers * max(0.0, passes * (cp - 1) * step - (attn_f + attn_b))
    return {"fwd": fwd, "compute": compute, "wgrad": wgrad, "tp_comm": tp_comm, "cp_comm": cp_comm}
