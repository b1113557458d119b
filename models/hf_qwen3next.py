"""Hugging Face's Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``) as a megazero
transformer whose layers put Gated DeltaNet in the attention place (``--experimental-attention-variant
gated_delta_net --linear-attention-freq``, docs/hybrid.md), both directions, tensor by tensor.

What maps to what:

- ``layer_types``: ``linear_attention`` layers are Gated DeltaNet (``--linear-attention-freq`` 1),
  ``full_attention`` layers gated attention (``--attention-output-gate``) with q/k norms per head and
  RoPE on the first ``partial_rotary_factor`` of each head (``--rotary-percent``).  Every layer keeps
  its MLP: a mixture of experts with a shared expert behind a sigmoid gate (Qwen2-MoE's, its weights
  under the same names) where ``mlp_only_layers`` / ``decoder_sparse_step`` say so, else a SwiGLU MLP.
- Norms: the layer norms, the final norm and the q/k norms scale by ``1 + weight`` (zero-centred);
  megazero stores ``1 + weight`` as Gemma's import does (:data:`models.hf.OFFSET_NORMS`).  The
  DeltaNet's gated norm (one ``[value_head_dim]`` scale, normalise then gate by ``silu(z)``) is plain.
- ``self_attn.q_proj`` holds each head's query rows and then its gate rows (``[heads, 2 x head_dim]``);
  megazero has a fused QKV (grouped per key/value head) and a gate projection of its own
  (``attention.gate.weight``): the import splits each head's rows, the export interleaves them back.
- ``linear_attn.in_proj_qkvz`` is ``[key head][q, k, v, z]`` and ``in_proj_ba`` ``[key head][b, a]``;
  megazero's ``attention.in_proj`` is ``[key head][q, k, v, z, b, a]`` (both group the value heads of a
  key head together).  ``linear_attn.conv1d`` channels are ``[q all heads | k all heads | v all heads]``;
  megazero's ``[key head][q, k, v]``.  ``A_log``, ``dt_bias``, the norm and ``out_proj`` keep their order.

Fields megazero cannot reproduce are refused by name (:func:`import_settings`); what Qwen3-Next cannot
hold of a megazero model is :func:`missing`; :func:`hf_config` writes the config.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

KIND = "qwen3_next"
# one-to-one tensors of a Gated DeltaNet layer: (megazero name, transformers name, how)
DELTANET_NAMES = [("attention.A_log", "linear_attn.A_log", ""),
                  ("attention.dt_bias", "linear_attn.dt_bias", ""),
                  ("attention.norm.weight", "linear_attn.norm.weight", ""),
                  ("attention.out_proj.weight", "linear_attn.out_proj.weight", "")]
# the tensors whose layouts differ (:func:`layer_tensor`, :func:`export_groups`)
REGROUPED = ("attention.qkv.weight", "attention.gate.weight", "attention.in_proj.weight",
             "attention.conv1d.weight")
LAYER_TYPES = ("linear_attention", "full_attention")


def _unsupported(field: str, value, fix: str):
    from megazero.config import ConfigError
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def every_nth(flags: List[bool]) -> Optional[int]:
    """``N`` when ``flags`` (one per layer, True for Gated DeltaNet) keep attention in every ``N``-th
    layer exactly (Megatron-LM's integer ``--linear-attention-freq``), else None."""
    return next((n for n in range(2, len(flags) + 1)
                 if flags == [(i + 1) % n != 0 for i in range(len(flags))]), None)


def import_settings(c) -> Dict[str, Any]:
    """megazero's ModelConfig settings of a ``Qwen3NextConfig``; :class:`ConfigError` naming the field,
    its value and what megazero lacks for anything else."""
    from .hf_config import moe_pattern, rope_settings
    if c.hidden_act != "silu":
        _unsupported("hidden_act", c.hidden_act, "megazero's Qwen3-Next has SwiGLU MLPs and SiLU after the "
                     "Gated DeltaNet conv")
    if getattr(c, "attention_bias", False):
        _unsupported("attention_bias", True, "linear biases on the attention projections are not implemented")
    types = list(c.layer_types)
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        _unsupported("layer_types", unknown, "only linear_attention (Gated DeltaNet) and full_attention "
                     "layers are implemented")
    rope = rope_settings(c, partial_ok=True)
    scaled = sorted(set(rope) - {"rotary_base", "rotary_percent"})
    if scaled:
        _unsupported("rope_parameters.rope_type", c.rope_parameters.get("rope_type"),
                     "megazero's Qwen3-Next has plain RoPE on part of each head (scaled RoPE with "
                     "partial_rotary_factor is not implemented)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    out: Dict[str, Any] = dict(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads or c.num_attention_heads, kv_channels=head_dim,
        ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings, seq_length=c.max_position_embeddings,
        norm_epsilon=c.rms_norm_eps, position_embedding_type="rope", normalization="RMSNorm",
        activation="swiglu", add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings, hidden_dropout=0.0,
        attention_dropout=float(c.attention_dropout or 0.0), init_method_std=c.initializer_range,
        qk_layernorm=True, qk_layernorm_scope="head", attention_output_gate=True, hf_model_type=KIND, **rope)
    linear = [t == "linear_attention" for t in types]
    if any(linear):
        out.update(experimental_attention_variant="gated_delta_net",
                   linear_attention_freq=every_nth(linear) or [int(f) for f in linear],
                   linear_num_key_heads=c.linear_num_key_heads,
                   linear_num_value_heads=c.linear_num_value_heads,
                   linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
                   linear_conv_kernel_dim=c.linear_conv_kernel_dim)
    return dict(out, **_moe_settings(c, moe_pattern))


def _moe_settings(c, moe_pattern: Callable[[List[bool]], str]) -> Dict[str, Any]:
    """The MoE settings: transformers' layer rule (``mlp_only_layers``, ``decoder_sparse_step``), softmax
    routing with the top-k renormalised when ``norm_topk_prob`` (else ``--moe-router-pre-softmax``), the
    shared expert and its sigmoid gate; {} when no layer has experts."""
    experts = int(getattr(c, "num_experts", 0) or 0)
    dense = set(c.mlp_only_layers or [])
    step = int(c.decoder_sparse_step or 1)
    flags = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(c.num_hidden_layers)]
    if not any(flags):
        return {}
    shared = int(c.shared_expert_intermediate_size or 0)
    if not shared:
        _unsupported("shared_expert_intermediate_size", shared,
                     "Qwen3-Next's MoE layers have a shared expert; megazero builds one of a positive size "
                     "(--moe-shared-expert-intermediate-size)")
    coeff = float(c.router_aux_loss_coef) if getattr(c, "output_router_logits", False) else 0.0
    return dict(num_experts=experts, moe_router_topk=int(c.num_experts_per_tok),
                moe_ffn_hidden_size=int(c.moe_intermediate_size), moe_layer_freq=moe_pattern(flags),
                moe_router_score_function="softmax", moe_router_pre_softmax=not c.norm_topk_prob,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=coeff,
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)


def _has_attention(m) -> bool:
    from megazero.config.hybrid import linear_attention_layers
    return not all(linear_attention_layers(m) or [False])


def missing(m, moe=None) -> Optional[str]:
    """What Qwen3-Next cannot hold of ModelConfig ``m`` with MoEConfig ``moe`` (None: it holds it)."""
    from megazero.config.patterns import uses_rope, windowed_layers
    t = KIND
    if getattr(m, "hybrid_layer_pattern", None):
        return f"a hybrid layer stack, --hybrid-layer-pattern ({t} puts Gated DeltaNet in the attention " \
               "place: --experimental-attention-variant gated_delta_net)"
    wants = [("RMSNorm", m.normalization == "RMSNorm"), ("pre-norm layers", m.norm_position == "pre"),
             ("a SwiGLU MLP", m.activation == "swiglu"), ("no linear biases", not m.add_bias_linear),
             ("no QKV bias", not m.add_qkv_bias), ("no embedding scale", not m.scale_embedding),
             ("plain RoPE", uses_rope(m) and m.position_embedding_type == "rope" and not m.use_rope_scaling
              and not m.rotary_seq_len_interpolation_factor and not m.dynamic_rope_scaling_factor),
             ("no sliding window", not any(windowed_layers(m)))]
    if _has_attention(m):
        wants += [("--attention-output-gate on its attention layers", m.attention_output_gate),
                  ("--qk-layernorm per head on its attention layers",
                   m.qk_layernorm and m.qk_layernorm_scope == "head")]
    absent = [what for what, ok in wants if not ok]
    if absent:
        return f"{t} needs {absent[0]}"
    others = [f for f in ("attn_logit_softcapping", "final_logit_softcapping", "softmax_scale",
                          "no_rope_freq")
              if getattr(m, f) is not None]
    if others:
        return f"{others[0]} {getattr(m, others[0])} ({t} has none)"
    return _moe_missing(moe) if moe is not None and moe.num_experts else None


def _moe_missing(moe) -> Optional[str]:
    from .hf_export import softmax_router_missing  # hf_export dispatches to this module
    t = KIND
    why = softmax_router_missing(moe, t)
    if why:
        return why
    if not (moe.moe_shared_expert_intermediate_size and moe.moe_shared_expert_gate):
        return f"no gated shared expert ({t} has one: --moe-shared-expert-intermediate-size and " \
               "--moe-shared-expert-gate)"
    return None


def hf_config(m, moe=None):
    """The ``Qwen3NextConfig`` of a megazero model :func:`missing` accepts."""
    from transformers import Qwen3NextConfig
    from megazero.config.hybrid import linear_attention_layers
    from megazero.moe.settings import moe_layer_pattern
    linear = linear_attention_layers(m) or [False] * m.num_layers
    experts = bool(moe is not None and moe.num_experts)
    fields: Dict[str, Any] = dict(num_experts=0, mlp_only_layers=[], decoder_sparse_step=1)
    if experts:
        flags = moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
        coeff = moe.moe_aux_loss_coeff if moe.moe_router_load_balancing_type != "none" else 0.0
        fields.update(num_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
                      moe_intermediate_size=moe.moe_ffn_hidden_size,
                      shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
                      norm_topk_prob=not moe.moe_router_pre_softmax,
                      mlp_only_layers=[i for i, f in enumerate(flags) if not f],
                      output_router_logits=bool(coeff), router_aux_loss_coef=coeff or 0.001)
    out = Qwen3NextConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels, hidden_act="silu",
        max_position_embeddings=max(m.max_position_embeddings, m.seq_length),
        initializer_range=m.init_method_std,
        rms_norm_eps=m.norm_epsilon, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        rope_parameters={"rope_type": "default", "rope_theta": m.rotary_base,
                         "partial_rotary_factor": m.rotary_percent},
        attention_bias=False, attention_dropout=m.attention_dropout,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim, linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim, linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        layer_types=["linear_attention" if f else "full_attention" for f in linear],
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields)
    out.architectures = ["Qwen3NextForCausalLM"]
    return out


# ---- tensors --------------------------------------------------------------------------------------
def _deltanet_sizes(m):
    kh, r = m.linear_num_key_heads, m.linear_num_value_heads // m.linear_num_key_heads
    return kh, r, m.linear_key_head_dim, m.linear_value_head_dim


def layer_tensor(rest: str, cfg, get: Callable[[str], torch.Tensor], src: str) -> torch.Tensor:
    """megazero's layer tensor ``rest`` (one of :data:`REGROUPED`) from the transformers tensors of the
    layer under ``src`` (``model.layers.<i>.``)."""
    from .hf import _fuse_qkv
    m = cfg.model
    if rest == "attention.in_proj.weight":  # [key head][q, k, v, z] + [key head][b, a]
        kh = m.linear_num_key_heads
        qkvz, ba = get(src + "linear_attn.in_proj_qkvz.weight"), get(src + "linear_attn.in_proj_ba.weight")
        hidden = qkvz.shape[-1]
        return torch.cat([qkvz.reshape(kh, -1, hidden), ba.reshape(kh, -1, hidden)], 1).reshape(-1, hidden)
    if rest == "attention.conv1d.weight":  # [q | k | v] over all heads -> [key head][q, k, v]
        kh, r, dk, dv = _deltanet_sizes(m)
        w = get(src + "linear_attn.conv1d.weight")
        parts = w.split([kh * dk, kh * dk, kh * r * dv])
        return torch.cat([p.reshape(kh, -1, *w.shape[1:]) for p in parts], 1).reshape(w.shape)
    heads, d = m.num_attention_heads, m.kv_channels
    q_gate = get(src + "self_attn.q_proj.weight")
    query, gate = (t.reshape(heads * d, -1) for t in q_gate.reshape(heads, 2 * d, -1).chunk(2, dim=1))
    if rest == "attention.gate.weight":
        return gate
    k, v = get(src + "self_attn.k_proj.weight"), get(src + "self_attn.v_proj.weight")
    return _fuse_qkv(query, k, v, m.num_query_groups)


def export_groups(name: str, rest: str, dst: str, cfg) -> list:
    """The export groups (:data:`models.hf.ExportGroup`) of decoder parameter ``name`` (its layer part
    ``rest``, one of :data:`REGROUPED`): :func:`layer_tensor`'s inverse.  The query's gate goes with the
    fused QKV (one ``q_proj``)."""
    from .hf import _split_qkv
    m = cfg.model
    i = name.split(".")[1]
    if rest == "attention.gate.weight":
        return []
    if rest == "attention.qkv.weight":
        heads, d = m.num_attention_heads, m.kv_channels

        def q_k_v(qkv, gate):
            q, k, v = _split_qkv(qkv, heads, m.num_query_groups, d)
            q_gate = torch.cat([q.reshape(heads, d, -1), gate.reshape(heads, d, -1)], 1)
            return [q_gate.reshape(2 * heads * d, -1), k, v]
        return [([name, f"decoder.{i}.attention.gate.weight"],
                 [f"{dst}self_attn.{n}_proj.weight" for n in "qkv"], q_k_v)]
    kh, r, dk, dv = _deltanet_sizes(m)
    if rest == "attention.in_proj.weight":
        def qkvz_ba(w):
            qkvz, ba = w.reshape(kh, -1, w.shape[-1]).split([2 * dk + 2 * r * dv, 2 * r], 1)
            return [qkvz.reshape(-1, w.shape[-1]), ba.reshape(-1, w.shape[-1])]
        return [([name], [dst + "linear_attn.in_proj_qkvz.weight", dst + "linear_attn.in_proj_ba.weight"],
                 qkvz_ba)]

    def channels(w):  # [key head][q, k, v] -> [q | k | v]
        q, k, v = w.reshape(kh, -1, *w.shape[1:]).split([dk, dk, r * dv], 1)
        return [torch.cat([t.reshape(-1, *w.shape[1:]) for t in (q, k, v)])]
    return [([name], [dst + "linear_attn.conv1d.weight"], channels)]
