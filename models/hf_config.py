"""Hugging Face configs to megazero's ModelConfig settings, for the architectures megazero reproduces
exactly: GPT-2, LLaMA (RoPE scaling of the ``llama3``, ``linear``, ``yarn`` and ``dynamic`` types),
Mistral and Qwen2 (with their sliding windows), Qwen3 (q/k norms), Gemma and Gemma 2 (norms with
``1 + weight``, the embedding scale, GeGLU; Gemma 2's sandwich norms, soft-caps and alternating
windows), Phi-3 (fused weights), OLMo 2 (norms after each sublayer, q/k norms over all heads),
SmolLM3 (layers without RoPE) and the mixtures of experts Mixtral, Qwen2-MoE (a shared expert with its
sigmoid gate), Qwen3-MoE and OLMoE (:func:`moe_settings`); Gemma 3, Llama 4, gpt-oss, GLM-4.5 and
DeepSeek-V3 (:mod:`models.hf_sigmoid_moe`, :mod:`models.hf_deepseek`); Qwen3-Next
(:mod:`models.hf_qwen3next`).  The other direction is :mod:`models.hf_export`.

Anything else is refused by name: :class:`ConfigError` naming the Hugging Face field, its value and
the feature megazero lacks (or, for another architecture, what it would need).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from megazero.config import ConfigError
from .hf_export import arch_of, hf_config_from  # noqa: F401 - the export direction, public names here too
from .hf_deepseek import mla_settings
from .hf_mamba import HYBRID_ARCHS, import_settings as hybrid_settings
from . import hf_qwen3next
from .hf_llama4 import import_settings as llama4_moe
from .hf_sigmoid_moe import KINDS as SIGMOID_MOE, import_settings
from .rope import yarn_attention_factor

GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}  # HF -> megazero
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "smollm3",
                "gemma3_text", "llama4_text")
GEMMA = ("gemma", "gemma2", "gemma3_text")
# architectures megazero does not import, and the feature each would need
OTHER_ARCHITECTURES = {
    "olmo": "OLMo (1)'s non-parametric layer norm (LayerNorm without a scale or bias) and clip_qkv",
    "gemma3": "Gemma 3's vision tower (its text model, model_type gemma3_text, imports)",
    "llama4": "Llama 4's vision tower (its text model, model_type llama4_text, imports)",
    "olmo3": "OLMo 3's RoPE parameters per layer type (rope_parameters for sliding and full attention apart)",
    "phi": "Phi-1/2's partial rotary embeddings, parallel attention and MLP, and LayerNorm with biases",
    "gpt_neox": "GPT-NeoX's parallel attention and MLP and partial rotary embeddings",
    "falcon": "Falcon's parallel attention and MLP (and ALiBi in some)",
}
MOE_FAMILY = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe", "deepseek_v3")


def _unsupported(field: str, value, fix: str):
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def config_from_hf(hf_config) -> Dict[str, Any]:
    """ModelConfig field overrides equivalent to a transformers config of one of the architectures in
    the module docstring; :class:`ConfigError` naming the field and the missing feature otherwise."""
    kind = getattr(hf_config, "model_type", None)
    quant = getattr(hf_config, "quantization_config", None)
    if quant:  # DeepSeek-V3's published files are fp8 blocks with their scales (weight_scale_inv)
        method = quant.get("quant_method") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", quant)
        _unsupported("quantization_config.quant_method", method, "quantised weights are not read; convert a "
                     "dequantised (bf16 or fp32) copy of the model")
    if kind == "gpt2":
        return _gpt2_settings(hf_config)
    if kind in HYBRID_ARCHS:  # Mamba-2, Nemotron-H: models.hf_mamba
        return hybrid_settings(hf_config, kind)
    if kind == hf_qwen3next.KIND:  # Qwen3-Next: models.hf_qwen3next
        return hf_qwen3next.import_settings(hf_config)
    if kind in LLAMA_FAMILY + MOE_FAMILY:
        out = dict(_llama_settings(hf_config, kind), **_family_settings(hf_config, kind), hf_model_type=kind)
        return dict(out, **moe_settings(hf_config, kind)) if kind in MOE_FAMILY else out
    check_model_type(kind)
    raise AssertionError(kind)  # check_model_type accepts only the kinds above


def check_model_type(kind) -> None:
    """:class:`ConfigError` unless ``kind`` (a config's ``model_type``) is an architecture megazero
    imports, naming what another one would need."""
    known = ("gpt2",) + LLAMA_FAMILY + MOE_FAMILY + HYBRID_ARCHS + (hf_qwen3next.KIND,)
    if kind in known:
        return
    if isinstance(kind, str) and kind in OTHER_ARCHITECTURES:
        raise ConfigError(f"unsupported Hugging Face config: model_type={kind!r} needs "
                          f"{OTHER_ARCHITECTURES[kind]}, which megazero does not implement")
    raise ConfigError(f"unsupported Hugging Face config: model_type={kind!r}; megazero imports "
                      f"{', '.join(repr(k) for k in known)}")


def _gpt2_settings(c) -> Dict[str, Any]:
    if c.activation_function not in GPT2_ACTIVATIONS:
        _unsupported("activation_function", c.activation_function,
                     f"megazero's GPT-2 uses one of {', '.join(GPT2_ACTIVATIONS)}")
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if getattr(c, field, ok) != ok:
            _unsupported(field, getattr(c, field), f"only {field}={ok} is supported")
    return dict(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                ffn_hidden_size=c.n_inner or 4 * c.n_embd, vocab_size=c.vocab_size,
                max_position_embeddings=c.n_positions, seq_length=c.n_positions,
                norm_epsilon=c.layer_norm_epsilon, position_embedding_type="learned_absolute",
                normalization="LayerNorm", activation=GPT2_ACTIVATIONS[c.activation_function],
                add_bias_linear=True, untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop,
                init_method_std=c.initializer_range)


def _rope_dict(c) -> Dict[str, Any]:
    return dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})


def _yarn(rope: Dict[str, Any], c) -> Dict[str, Any]:
    """Megatron-LM's YaRN settings of transformers' ``yarn`` rope_parameters."""
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or c.max_position_embeddings / original)
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and all_dim):  # transformers then uses 0.1 ln(factor) + 1
        mscale, all_dim = 1.0, 0.0
    out = dict(position_embedding_type="yarn", rotary_scaling_factor=factor,
               yarn_original_max_position_embeddings=original,
               yarn_beta_fast=float(rope.get("beta_fast") or 32),
               yarn_beta_slow=float(rope.get("beta_slow") or 1),
               yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
               mscale=float(mscale), mscale_all_dim=float(all_dim))
    given = rope.get("attention_factor")
    if given is not None:
        ours = yarn_attention_factor(dict(out, factor=factor))
        if not math.isclose(given, ours, rel_tol=1e-12):  # Megatron-LM's mscale: 0.1 mscale ln(f) + 1
            if factor <= 1:
                _unsupported("rope_scaling.attention_factor", given,
                             "YaRN's attention factor is 1 for factor <= 1")
            out["mscale"] = (given - 1) / (0.1 * math.log(factor))
            out["mscale_all_dim"] = 0.0
    return out


def rope_settings(c, partial_ok: bool = False) -> Dict[str, Any]:
    """``rotary_base`` and the RoPE scaling fields of a LLaMA-family config's ``rope_parameters``
    (``rope_scaling`` in older transformers); with ``partial_ok`` (GLM-4.5: RoPE on the first channels
    of a head, halves of them rotated) its ``partial_rotary_factor`` as ``rotary_percent``."""
    rope = _rope_dict(c)
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = rope.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0)
    out: Dict[str, Any] = dict(rotary_base=float(base))
    partial = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", None) or 1.0)
    if float(partial) != 1.0 and partial_ok:
        out["rotary_percent"] = float(partial)
    elif float(partial) != 1.0:
        _unsupported("partial_rotary_factor", partial,
                     "partial rotary embeddings (RoPE on part of each head) are not implemented")
    if kind == "llama3":
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                   rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(
                       rope["original_max_position_embeddings"]))
    elif kind == "linear":
        out.update(rotary_seq_len_interpolation_factor=float(rope["factor"]))
    elif kind == "dynamic":
        out.update(dynamic_rope_scaling_factor=float(rope["factor"]))
    elif kind == "yarn":
        out.update(_yarn(rope, c))
    elif kind != "default":
        _unsupported("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"},
                     "megazero implements plain RoPE and the 'llama3', 'linear', 'yarn' and 'dynamic' "
                     f"rope_type ({kind!r} is not implemented)")
    return out


def _llama_settings(c, kind: str) -> Dict[str, Any]:
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
    want = "gelu_pytorch_tanh" if kind in GEMMA else "silu"
    if act != want and not (want == "gelu_pytorch_tanh" and act in ("gelu_new", "gelu_fast")):
        _unsupported("hidden_act", act, f"megazero's {kind} MLP is gated with {want}")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(c, field, False) and not (kind in ("qwen2", "gpt_oss", "glm4_moe")
                                             and field == "attention_bias"):
            _unsupported(field, True, "linear biases on all attention projections (or the MLP) are not "
                         "implemented (Qwen2's query/key/value-only bias is)")
    if getattr(c, "use_bidirectional_attention", None):
        _unsupported("use_bidirectional_attention", True, "attention is causal only")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return dict(dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                num_attention_heads=c.num_attention_heads,
                num_query_groups=c.num_key_value_heads or c.num_attention_heads, kv_channels=head_dim,
                ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size,
                max_position_embeddings=c.max_position_embeddings, seq_length=c.max_position_embeddings,
                norm_epsilon=c.rms_norm_eps, position_embedding_type="rope", normalization="RMSNorm",
                activation="swiglu", add_bias_linear=False,
                add_qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and bool(getattr(c, "qkv_bias", True)))
                or (kind == "glm4_moe" and bool(c.attention_bias)),
                untie_embeddings_and_output_weights=not c.tie_word_embeddings,
                hidden_dropout=float(getattr(c, "resid_pdrop", 0.0) or 0.0),
                attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
                init_method_std=c.initializer_range),
                **(gemma3_rope_settings(c) if kind == "gemma3_text"
                   else rope_settings(c, partial_ok=kind == "glm4_moe")))


def gemma3_rope_settings(c) -> Dict[str, Any]:
    """Gemma 3's RoPE per layer type: the full-attention layers' base and scaling, and the sliding-window
    layers' plain base (``--rotary-base-local``)."""
    rope = _rope_dict(c)
    if "full_attention" not in rope:  # one RoPE for every layer
        return rope_settings(c)
    full = type("Full", (), dict(rope_parameters=rope["full_attention"],
                                 max_position_embeddings=c.max_position_embeddings))()
    out = rope_settings(full)
    local = rope.get("sliding_attention")
    if local and "sliding_attention" in (getattr(c, "layer_types", None) or []):
        if local.get("rope_type", "default") != "default":
            _unsupported("rope_parameters.sliding_attention", local, "megazero's local RoPE base "
                         "(--rotary-base-local) is plain RoPE")
        out["rotary_base_local"] = float(local["rope_theta"])
    return out


def _windows(c, kind: str) -> Dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` of the sliding window of ``c``: the layers of
    ``layer_types`` marked ``sliding_attention`` (every layer for Mistral and Phi-3) attend to the last
    ``sliding_window`` positions (their own included)."""
    width = getattr(c, "sliding_window", None)
    if kind == "smollm3" and not getattr(c, "use_sliding_window", False):
        width = None
    if kind not in ("mistral", "qwen2", "qwen3", "gemma2", "phi3", "smollm3", "mixtral", "qwen2_moe",
                    "qwen3_moe", "gemma3_text", "gpt_oss") or not width:
        return {}
    types: List[str] = list(getattr(c, "layer_types", None) or [])
    flags = [True] * c.num_hidden_layers if kind in ("mistral", "phi3", "mixtral") or not types else \
        [t == "sliding_attention" for t in types]
    unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if unknown:
        _unsupported("layer_types", unknown,
                     "only sliding_attention and full_attention layers are implemented")
    if not any(flags):
        return {}
    out: Dict[str, Any] = dict(window_size=[int(width) - 1, 0])
    if not all(flags):
        every = next((n for n in range(2, len(flags) + 1)
                      if flags == [(i + 1) % n != 0 for i in range(len(flags))]), None)
        out["window_attn_skip_freq"] = every or [int(f) for f in flags]
    return out


def _family_settings(c, kind: str) -> Dict[str, Any]:
    """What each architecture adds to the LLaMA layout."""
    out = _windows(c, kind)
    if kind in ("qwen3", "qwen3_moe"):
        out.update(qk_layernorm=True, qk_layernorm_scope="head")
    if kind in ("olmo2", "olmoe"):
        out.update(qk_layernorm=True, qk_layernorm_scope="all")
    if kind == "deepseek_v3":
        out.update(mla_settings(c, rope_settings(c)))
    if kind == "glm4_moe" and c.use_qk_norm:
        out.update(qk_layernorm=True, qk_layernorm_scope="head")
    if kind == "olmo2":
        out.update(norm_position="post")
    if kind == "olmoe" and getattr(c, "clip_qkv", None) is not None:
        _unsupported("clip_qkv", c.clip_qkv, "clamping the queries, keys and values is not implemented")
    if kind in GEMMA:
        out.update(activation="geglu", scale_embedding=True)
    if kind == "gemma3_text":  # Gemma 2's layout, q/k norms instead of soft-caps (which it keeps optional)
        out.update(qk_layernorm=True, qk_layernorm_scope="head")
    if kind in ("gemma2", "gemma3_text"):
        out.update(norm_position="sandwich", attn_logit_softcapping=_float(c.attn_logit_softcapping),
                   final_logit_softcapping=_float(c.final_logit_softcapping),
                   softmax_scale=float(c.query_pre_attn_scalar) ** -0.5)
    if kind == "gpt_oss":
        out.update(gpt_oss_settings(c))
    if kind == "llama4_text":
        out.update(llama4_settings(c))
    if kind == "smollm3":
        use = list(getattr(c, "no_rope_layers", None) or [1] * c.num_hidden_layers)
        if not all(use):
            skip = [1 - int(u) for u in use]
            every = next((n for n in range(1, len(skip) + 1) if len(skip) % n == 0
                          and skip == [int((i + 1) % n == 0) for i in range(len(skip))]), None)
            out["no_rope_freq"] = every or skip
    return out


def gpt_oss_settings(c) -> Dict[str, Any]:
    """gpt-oss's attention sinks, biases (attention, experts, router) and clamped SwiGLU
    (docs/attention.md)."""
    from megazero.tensor_parallel.activations import QUICK_GELU_ALPHA
    if float(getattr(c, "swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
        _unsupported("swiglu_alpha", c.swiglu_alpha, f"megazero's quick-GeGLU has alpha {QUICK_GELU_ALPHA}")
    if not getattr(c, "attention_bias", False):
        _unsupported("attention_bias", False, "megazero's gpt-oss has biased attention projections")
    return dict(softmax_type="learnable", activation="quick_geglu", glu_linear_offset=1.0,
                activation_func_clamp_value=float(c.swiglu_limit), add_bias_linear=True)


def llama4_settings(c) -> Dict[str, Any]:
    """Llama 4 (text): NoPE layers, chunked attention on the RoPE layers, the L2 q/k norm there and the
    attention temperature on the others (docs/attention.md); its MoE layers (``moe_layers``):
    :func:`models.hf_llama4.import_settings`.  Its RoPE rotates interleaved channel pairs; the import
    reorders each query/key head's channels to halves (models.hf)."""
    rope = [bool(u) for u in c.no_rope_layers]
    chunked = [t == "chunked_attention" for t in c.layer_types]
    chunk = c.attention_chunk_size if any(chunked) else None
    if any(chunked) and chunked != rope:
        _unsupported("layer_types", c.layer_types,
                     "megazero chunks the layers that use RoPE (no_rope_layers: 1)")
    out: Dict[str, Any] = dict(ffn_hidden_size=c.intermediate_size_mlp, attention_chunk_size=chunk,
                               **llama4_moe(c))
    if not all(rope):
        skip = [int(not u) for u in rope]
        every = next((n for n in range(1, len(skip) + 1) if len(skip) % n == 0
                      and skip == [int((i + 1) % n == 0) for i in range(len(skip))]), None)
        out["no_rope_freq"] = every or skip
    if c.use_qk_norm:
        out.update(qk_l2_norm=True, qk_l2_norm_scope="rope")
    if c.attn_temperature_tuning and any(rope) and not all(rope):
        out.update(attn_temperature_tuning=True, attn_temperature_floor_scale=float(c.floor_scale),
                   attn_temperature_scale=float(c.attn_scale))
    return out


def _float(v) -> Optional[float]:
    return None if v is None else float(v)


def moe_pattern(flags: List[bool]) -> str:
    """``--moe-layer-freq`` of one flag per layer: ``1`` (every layer) or the list of 0s and 1s."""
    return "1" if all(flags) else "[" + ",".join(str(int(f)) for f in flags) + "]"


def moe_settings(c, kind: str) -> Dict[str, Any]:
    """The MoE settings of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.  Routing: transformers takes
    the softmax over all experts, the top-k of it, and renormalises the k weights (Mixtral always, the
    others with ``norm_topk_prob``): the softmax over the top-k logits, Megatron-LM's default; without
    renormalising it is ``--moe-router-pre-softmax``.  Dropless (no capacity).  The load-balancing loss
    is ``router_aux_loss_coef`` when the config adds it to the loss (``output_router_logits``).  GLM-4.5
    and DeepSeek-V3: :func:`models.hf_sigmoid_moe.import_settings`."""
    if kind in SIGMOID_MOE:
        return import_settings(c, kind)
    experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0) or 0)
    layers = c.num_hidden_layers
    if kind in ("qwen2_moe", "qwen3_moe"):
        dense = set(getattr(c, "mlp_only_layers", None) or [])
        step = int(getattr(c, "decoder_sparse_step", 1) or 1)
        flags = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)]
        ffn = c.moe_intermediate_size
    else:
        flags, ffn = [experts > 0] * layers, c.intermediate_size
    if not any(flags):
        _unsupported("num_experts", experts,
                     f"a {kind} config without MoE layers: import it as a dense model")
    jitter = getattr(c, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        _unsupported("router_jitter_noise", jitter, "jitter on the router's input (Megatron-LM's "
                     "--moe-input-jitter-eps) is not implemented")
    # gpt-oss: the softmax of the top-k logits (its router's bias added first)
    renormalise = kind in ("mixtral", "gpt_oss") or bool(getattr(c, "norm_topk_prob", False))
    out: Dict[str, Any] = dict(num_experts=experts, moe_router_topk=int(c.num_experts_per_tok),
                               moe_ffn_hidden_size=int(ffn), moe_layer_freq=moe_pattern(flags),
                               moe_router_score_function="softmax", moe_router_pre_softmax=not renormalise,
                               moe_router_load_balancing_type="aux_loss",
                               moe_aux_loss_coeff=float(c.router_aux_loss_coef)
                               if getattr(c, "output_router_logits", False) else 0.0)
    if kind == "gpt_oss":
        out["moe_router_bias"] = True
    shared = int(getattr(c, "shared_expert_intermediate_size", 0) or 0) if kind == "qwen2_moe" else 0
    if kind == "qwen2_moe" and not shared:
        _unsupported("shared_expert_intermediate_size", shared, "megazero's Qwen2-MoE has its shared expert")
    if shared:
        out.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return out
