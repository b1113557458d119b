"""Floating-point operations per iteration, and the device peaks that turn them into MFU.

*Model* FLOPs follow Megatron-LM's count (Narayanan et al. 2021, appendix): every matmul of
``m x n`` by ``n x k`` costs ``2mnk`` forward and twice that backward (input and weight
gradients), so 3x the forward in all.  Per token and layer the forward matmuls are

* attention projections: ``2 h (q + 2 kv)`` for Q, K, V and ``2 q h`` for the output,
  where ``q = heads x kv_channels`` and ``kv = query_groups x kv_channels``;
* attention itself: ``2 s q`` for scores and ``2 s q`` for the weighted values (the causal
  mask is not discounted, as in Megatron-LM); a layer with a sliding window counts the keys a
  query can see, ``min(s, window + 1)`` instead of ``s``, and a chunked one (``--attention-chunk-size C``)
  ``min(s, C)`` (averaged over the layers);
* MLP: ``2 x 2 h ffn`` (``x 3/2`` with SwiGLU's or GeGLU's third matrix); an MoE layer counts what a
  token runs through, its *active* parameters: the router ``2 h E``, ``topk`` experts of
  ``--moe-ffn-hidden-size`` and the shared expert with its gate (``2 h``);

plus ``2 h V`` per token for the output logits, and each multi-token prediction depth's layer, ``2h -> h``
projection and logits.  *Hardware* FLOPs add the forward work that
activation recomputation repeats: the recomputed layers' forward (full), or the attention
scores and weighted values (selective).  MFU uses model FLOPs.
"""
from __future__ import annotations

import re

from typing import Optional

from megazero.config.patterns import GATED, layer_uses_rope, layer_window

# Dense peak TFLOP/s per device: (16-bit tensor cores, fp32 without TF32).  Names are matched as
# whole words of torch.cuda.get_device_name() ("L4" does not match "L40"), most specific first.
PEAK_TFLOPS = (
    ("H200", (989.0, 67.0)),
    ("GH200", (989.0, 67.0)),
    ("H100 PCIe", (756.0, 51.0)),
    ("H100", (989.0, 67.0)),
    ("H800", (989.0, 67.0)),
    ("B200", (2250.0, 80.0)),
    ("A100", (312.0, 19.5)),
    ("A800", (312.0, 19.5)),
    ("A10G", (70.0, 31.2)),
    ("A10", (125.0, 31.2)),
    ("L40S", (362.0, 91.6)),
    ("L40", (181.0, 90.5)),
    ("L4", (121.0, 30.3)),
    ("A6000", (155.0, 38.7)),
    ("RTX 4090", (165.0, 82.6)),
    ("RTX 3090", (71.0, 35.6)),
    ("V100", (125.0, 15.7)),
    ("T4", (65.0, 8.1)),
    ("MI300X", (1307.0, 163.4)),
    ("MI250X", (383.0, 47.9)),
)


def layer_forward_flops_per_token(cfg) -> dict:
    """Forward FLOPs of one transformer layer for one token, split into matmuls and attention (the mean
    over the layers when MoE and dense layers mix)."""
    m = cfg.model
    if getattr(m, "hybrid_layer_pattern", None) or getattr(m, "experimental_attention_variant", None):
        from megazero.planning.hybrid_counts import hybrid_layer_flops
        return hybrid_layer_flops(cfg, _mlp_flops, mla_forward_flops)
    h, s = m.hidden_size, m.seq_length
    kv_ch = m.kv_channels or h // m.num_attention_heads
    q = m.num_attention_heads * kv_ch
    kv = (m.num_query_groups or m.num_attention_heads) * kv_ch
    mlp = _mlp_flops(cfg, False)
    moe = _moe_layer_count(cfg)
    if moe:  # the layers' mean: MoE layers count the experts a token goes through
        mlp = (mlp * (m.num_layers - moe) + _mlp_flops(cfg, True) * moe) / m.num_layers
    dense = 2 * h * (q + 2 * kv) + 2 * q * h + mlp
    windows = [layer_window(m, i) for i in range(m.num_layers)]
    chunks = [m.attention_chunk_size if layer_uses_rope(m, i) else None for i in range(m.num_layers)]
    keys = sum(min(s, s if w is None else w + 1, c or s)  # keys per query: window, chunk (Llama 4)
               for w, c in zip(windows, chunks)) / m.num_layers
    attention = 2 * keys * q + 2 * keys * q
    if m.multi_latent_attention:
        projections, attention = mla_forward_flops(m, keys)
        dense = projections + mlp
    return {"dense": dense, "attention": attention}


def mla_forward_flops(m, keys: float):
    """Multi-latent attention's forward FLOPs per token (``models/mla.py``): ``(projections, attention)``.
    Projections: the query's down- and up-projection (or its one projection), the key/value latent's
    down-projection (with the rotary part) and up-projection, the output; attention: scores over
    ``n (dn + dr)`` channels and weighted values over ``n dv``, for ``keys`` keys a query."""
    h, n, rq, rkv = m.hidden_size, m.num_attention_heads, m.q_lora_rank, m.kv_lora_rank
    dq, dv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    query = 2 * h * rq + 2 * rq * n * dq if rq else 2 * h * n * dq
    kv = 2 * h * (rkv + m.qk_pos_emb_head_dim) + 2 * rkv * n * (m.qk_head_dim + dv)
    return query + kv + 2 * n * dv * h, 2 * keys * n * dq + 2 * keys * n * dv


def _mlp_flops(cfg, moe_layer: bool) -> float:
    """Forward FLOPs per token of a layer's MLP: dense, or an MoE layer's router, ``topk`` experts and
    shared expert with its gate."""
    m = cfg.model
    h = m.hidden_size
    ffn = m.ffn_hidden_size or 4 * h
    glu = 1.5 if m.activation in GATED else 1.0
    if not moe_layer:
        return 2 * 2 * h * ffn * glu
    c = cfg.moe
    routed = 2 * h * c.num_experts + c.moe_router_topk * 2 * 2 * h * (c.moe_ffn_hidden_size or ffn) * glu
    shared = c.moe_shared_expert_intermediate_size
    if shared:
        routed += 2 * 2 * h * shared * glu + (2 * h if c.moe_shared_expert_gate else 0)
    return routed


def mtp_forward_flops_per_token(cfg) -> float:
    """Forward FLOPs per token of the multi-token prediction depths (``--mtp-num-layers``, as Megatron-LM
    counts them): each a transformer layer over the whole causal sequence (an MoE layer when the last
    decoder layer is one), the ``2h -> h`` projection and the head's logits."""
    m = cfg.model
    n = m.mtp_num_layers or 0
    if not n:
        return 0.0
    from megazero.moe.settings import mtp_moe_layers
    layer = layer_forward_flops_per_token(cfg)
    mean_mlp = _mlp_flops(cfg, False)
    if _moe_layer_count(cfg):
        moe = _moe_layer_count(cfg)
        mean_mlp = (mean_mlp * (m.num_layers - moe) + _mlp_flops(cfg, True) * moe) / m.num_layers
    h, s = m.hidden_size, m.seq_length
    q = m.num_attention_heads * (m.kv_channels or h // m.num_attention_heads)
    attention = mla_forward_flops(m, s)[1] if m.multi_latent_attention else 4 * s * q
    mlp = _mlp_flops(cfg, bool(mtp_moe_layers(cfg)))
    vocab = m.padded_vocab_size or m.vocab_size
    return n * (layer["dense"] - mean_mlp + mlp + attention + 2 * 2 * h * h + 2 * h * vocab)


def _moe_layer_count(cfg) -> int:
    """How many layers are MoE layers (0 for a dense model)."""
    moe = getattr(cfg, "moe", None)
    if moe is None or not moe.num_experts:
        return 0
    from megazero.moe.settings import moe_layers
    return len(moe_layers(cfg))


def model_flops_per_iteration(cfg) -> float:
    """Model FLOPs (forward + backward) of one optimizer step over the whole global batch."""
    m = cfg.model
    tokens = cfg.training.global_batch_size * m.seq_length
    layer = layer_forward_flops_per_token(cfg)
    vocab = m.padded_vocab_size or m.vocab_size
    forward = m.num_layers * (layer["dense"] + layer["attention"]) + 2 * m.hidden_size * vocab
    forward += mtp_forward_flops_per_token(cfg)  # multi-token prediction (0 without it)
    return 3.0 * forward * tokens


def recompute_flops_per_iteration(cfg) -> float:
    """Extra forward FLOPs spent on activation recomputation in one step (0 without it)."""
    m = cfg.model
    tokens = cfg.training.global_batch_size * m.seq_length
    layer = layer_forward_flops_per_token(cfg)
    if m.recompute_granularity == "selective":
        return m.num_layers * layer["attention"] * tokens
    if m.recompute_granularity == "full":
        fraction = 1.0
        if m.recompute_method == "block":
            per_stage = m.num_layers / cfg.parallel.pipeline_model_parallel_size
            fraction = min(1.0, (m.recompute_num_layers or per_stage) / per_stage)
        return fraction * m.num_layers * (layer["dense"] + layer["attention"]) * tokens
    return 0.0


def hardware_flops_per_iteration(cfg) -> float:
    """Model FLOPs plus recomputation: what the devices actually execute."""
    return model_flops_per_iteration(cfg) + recompute_flops_per_iteration(cfg)


def peak_flops(device_name: Optional[str], dtype: str = "bf16") -> Optional[float]:
    """Dense peak FLOP/s of one device (``dtype`` ``bf16``/``fp16``/``fp32``), None when unknown."""
    if not device_name:
        return None
    for key, (half, single) in PEAK_TFLOPS:
        if re.search(r"(?<![A-Za-z0-9])" + re.escape(key) + r"(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            return 1e12 * (single if dtype == "fp32" else half)
    return None


def device_peak_flops(device, dtype: str = "bf16") -> Optional[float]:
    """Peak FLOP/s of a torch device: from the table for CUDA devices, None on CPU."""
    import torch
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)
