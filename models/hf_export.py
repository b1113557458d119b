"""Which ``transformers`` architecture holds a megazero model, and its config (the export direction of
:mod:`models.hf_config`).

:func:`arch_of` is ``--hf-model-type`` (set by an import) when that architecture holds the model,
else the first of :data:`AUTO_ORDER` that does; :func:`missing` says what an architecture lacks to
hold a model (one line, naming the feature).  Phi-3 is never chosen by itself: it holds the same
models as LLaMA/Mistral with fused weights, so it is written only for a model imported from one
(or with ``--hf-model-type phi3``).  A mixture of experts (``--num-experts``) goes to the first of
:data:`MOE_ORDER` that holds it (:func:`moe_missing`: its routing, shared expert and MoE layers).
Gated DeltaNet in transformer layers (``--experimental-attention-variant``) or gated attention
(``--attention-output-gate``) goes to Qwen3-Next only (:mod:`models.hf_qwen3next`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megazero.config import ConfigError
from megazero.config.patterns import layer_flags, uses_rope, windowed_layers
from megazero.moe.settings import moe_layer_pattern
from .hf_deepseek import deepseek_fields, deepseek_missing, deepseek_rope
from . import hf_llama4
from .hf_mamba import HYBRID_ARCHS, hf_config as hybrid_config, missing as hybrid_missing
from . import hf_qwen3next
from .hf_sigmoid_moe import KINDS as SIGMOID_MOE, export_fields, export_missing
from .rope import yarn_mscale

AUTO_ORDER = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo2", "smollm3",
              "gemma3_text", "llama4_text")
MOE_ORDER = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe", "deepseek_v3",
             "llama4_text")  # Llama 4 holds dense models too (AUTO_ORDER)
LAYER_TYPES = ("qwen2", "qwen3", "gemma2", "smollm3", "qwen2_moe", "gemma3_text", "gpt_oss")  # per layer
GEMMA = ("gemma", "gemma2", "gemma3_text")
SANDWICH = ("gemma2", "gemma3_text")  # Gemma 2's layout: sandwich norms, soft-caps, its own score scale
WHOLE_WINDOW = ("mistral", "phi3", "mixtral", "qwen3_moe")  # one window on every layer, or none
HELD_VARIANTS: Dict[str, tuple] = {  # of docs/attention.md
    "gemma3_text": ("--rotary-base-local",),
    "glm4_moe": ("--rotary-percent",),
    "qwen3_next": ("--rotary-percent",),
    "llama4_text": ("--attention-chunk-size", "--qk-l2-norm", "--attn-temperature-tuning"),
    "gpt_oss": ("--softmax-type", "--activation", "--glu-linear-offset", "--activation-func-clamp-value",
                "--moe-router-bias")}


def _scalings(m) -> List[str]:
    out = [k for k, on in (("llama3", m.use_rope_scaling), ("linear", m.rotary_seq_len_interpolation_factor),
                           ("yarn", m.position_embedding_type == "yarn"),
                           ("dynamic", m.dynamic_rope_scaling_factor)) if on]
    return out


def _window_kind(m) -> Optional[str]:
    """None (no window), 'all' (every layer) or 'some'."""
    flags = windowed_layers(m)
    return None if not any(flags) else ("all" if all(flags) else "some")


def _llama_family(m, t: str) -> Optional[str]:
    """What the LLaMA-like architecture ``t`` lacks to hold ``m`` (None: nothing)."""
    gemma = t in GEMMA
    wants = {"activation": "geglu" if gemma else "swiglu",
             "norm_position": "sandwich" if t in SANDWICH else ("post" if t == "olmo2" else "pre")}
    for field, value in wants.items():
        if getattr(m, field) != value:
            return f"{field} {getattr(m, field)} ({t} has {value})"
    if m.scale_embedding != gemma:
        return f"scale_embedding {m.scale_embedding} ({t}: {gemma})"
    qk = {"qwen3": "head", "olmo2": "all", "qwen3_moe": "head", "olmoe": "all",
          "gemma3_text": "head"}.get(t)
    if t == "glm4_moe" and m.qk_layernorm_scope == "head":  # GLM-4.5's q/k norm is optional
        qk = "head" if m.qk_layernorm else None
    if (m.qk_layernorm and m.qk_layernorm_scope) != (qk or False):
        mine = f"scope {m.qk_layernorm_scope}" if m.qk_layernorm else "off"
        return f"--qk-layernorm {mine} ({t}: {qk or 'none'})"
    if m.add_qkv_bias != (t == "qwen2") and t not in ("qwen2_moe", "glm4_moe"):
        return f"add_qkv_bias {m.add_qkv_bias} ({t}: {t == 'qwen2'})"
    window = _window_kind(m)
    uniform = LAYER_TYPES + WHOLE_WINDOW
    if window == "some" and t not in LAYER_TYPES or window == "all" and t not in uniform:
        return f"a sliding window on {'some' if window == 'some' else 'all'} layers ({t} has " + \
               ("it on every layer or none)" if t in WHOLE_WINDOW else "none)")
    if t in SANDWICH:
        return "layers without RoPE, --no-rope-freq (SmolLM3 only)" if m.no_rope_freq is not None else None
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "softmax_scale"):
        if getattr(m, field) is not None:
            return f"{field} {getattr(m, field)} (Gemma 2 only)"
    if m.no_rope_freq is not None and t not in ("smollm3", "llama4_text"):
        return "layers without RoPE, --no-rope-freq (SmolLM3 and Llama 4 only)"
    if t == "llama4_text" and m.qk_l2_norm and m.qk_l2_norm_scope != "rope" and m.no_rope_freq is not None:
        return "--qk-l2-norm-scope all (Llama 4 normalises its RoPE layers only)"
    if t == "llama4_text" and m.attn_temperature_tuning and \
            m.attn_temperature_floor_scale != int(m.attn_temperature_floor_scale):
        return f"--attn-temperature-floor-scale {m.attn_temperature_floor_scale} (Llama 4's is an integer)"
    if t == "phi3" and _scalings(m):
        return f"RoPE scaling {_scalings(m)[0]} (Phi-3: plain or longrope)"
    return None


def softmax_router_missing(moe, t: str) -> Optional[str]:
    """What the plain softmax top-k router of architecture ``t`` lacks of MoEConfig ``moe``'s routing (no
    expert bias, scaling or groups; None: nothing)."""
    if moe.moe_router_score_function != "softmax":
        return f"--moe-router-score-function {moe.moe_router_score_function} ({t}: softmax)"
    if moe.moe_router_enable_expert_bias:
        return f"--moe-router-enable-expert-bias ({t} has no expert bias)"
    if moe.moe_router_topk_scaling_factor not in (None, 1.0):
        return f"--moe-router-topk-scaling-factor {moe.moe_router_topk_scaling_factor} ({t} has none)"
    if moe.moe_router_num_groups:
        return f"group-limited routing, --moe-router-num-groups ({t} has none)"
    return None


def moe_missing(moe, m, t: str) -> Optional[str]:
    """What the MoE architecture ``t`` lacks to hold the experts of MoEConfig ``moe`` (None: nothing)."""
    why = softmax_router_missing(moe, t)
    if why:
        return why
    if t == "mixtral" and moe.moe_router_pre_softmax:
        return "--moe-router-pre-softmax (Mixtral renormalises the top-k weights)"
    if t in ("mixtral", "olmoe") and not all(moe_layer_pattern(moe.moe_layer_freq, m.num_layers)):
        return f"dense layers among the MoE layers, --moe-layer-freq {moe.moe_layer_freq} " \
               f"({t}: every layer MoE)"
    shared = moe.moe_shared_expert_intermediate_size
    if t == "qwen2_moe" and not (shared and moe.moe_shared_expert_gate):
        return "no gated shared expert (qwen2_moe has one: --moe-shared-expert-intermediate-size and " \
               "--moe-shared-expert-gate)"
    if t != "qwen2_moe" and shared:
        return f"a shared expert, --moe-shared-expert-intermediate-size ({t} has none)"
    return None


def missing(m, t: str, moe=None) -> Optional[str]:
    """What transformers' architecture ``t`` cannot hold of ModelConfig ``m`` with MoEConfig ``moe``
    (None: it holds it)."""
    experts = bool(moe is not None and moe.num_experts)
    if experts and moe.moe_apply_probs_on_input and t != "llama4_text":
        return f"--moe-apply-probs-on-input ({t} weighs the experts' outputs; llama4_text their inputs)"
    if m.mtp_num_layers and t not in ("deepseek_v3", "glm4_moe"):
        return f"multi-token prediction, --mtp-num-layers ({t} has none)"
    if m.multi_latent_attention and t != "deepseek_v3":
        return f"multi-latent attention, --multi-latent-attention ({t} has none; deepseek_v3 holds it " \
               "with DeepSeek-V3's mixture of experts)"
    if t in HYBRID_ARCHS:  # Mamba-2, Nemotron-H (models.hf_mamba)
        return hybrid_missing(m, t, moe) or variants_missing(m, moe, t)
    if t == hf_qwen3next.KIND:  # Qwen3-Next (models.hf_qwen3next)
        return hf_qwen3next.missing(m, moe) or variants_missing(m, moe, t)
    if getattr(m, "hybrid_layer_pattern", None):
        return f"a hybrid layer stack, --hybrid-layer-pattern ({t} has transformer layers only)"
    if getattr(m, "experimental_attention_variant", None):
        return f"Gated DeltaNet layers, --experimental-attention-variant ({t} has attention only)"
    if getattr(m, "attention_output_gate", False):
        return f"the attention output gate, --attention-output-gate ({t} has none)"
    if experts != (t in MOE_ORDER) and t != "llama4_text":  # Llama 4: MoE layers or none
        return f"mixture-of-experts layers ({t} has {'none' if experts else 'them'})"
    variant = variants_missing(m, moe, t)
    if t == "gpt_oss":
        return variant or gpt_oss_missing(m, moe)
    if t == "deepseek_v3":
        return variant or deepseek_missing(m) or export_missing(moe, m, t)
    if t in SIGMOID_MOE:
        return variant or _dense_missing(m, t) or export_missing(moe, m, t)
    if t == "llama4_text" and experts:
        return variant or _dense_missing(m, t) or hf_llama4.export_missing(moe, m)
    if experts:
        return variant or _dense_missing(m, t) or moe_missing(moe, m, t)
    return variant or _dense_missing(m, t)


def variants_missing(m, moe, t: str) -> Optional[str]:
    """The attention/MLP variants of docs/attention.md that architecture ``t`` lacks (None: it holds
    every one ``m`` uses)."""
    held = HELD_VARIANTS.get(t, ())
    used = [(flag, on) for flag, on in (
        (f"--softmax-type {m.softmax_type}", m.softmax_type != "vanilla"),
        ("--attention-chunk-size", m.attention_chunk_size is not None), ("--qk-l2-norm", m.qk_l2_norm),
        ("--attn-temperature-tuning", m.attn_temperature_tuning),
        (f"--rotary-percent {m.rotary_percent}", m.rotary_percent != 1.0),
        ("--rotary-base-local", m.rotary_base_local is not None),
        (f"--activation {m.activation}", m.activation == "quick_geglu"),
        ("--glu-linear-offset", m.glu_linear_offset != 0.0),
        ("--activation-func-clamp-value", m.activation_func_clamp_value is not None),
        ("--moe-router-bias", moe is not None and moe.moe_router_bias)) if on]
    for flag, _ in used:
        if flag.split(" ")[0] not in held:
            return f"{flag} ({t} has no such part; docs/attention.md)"
    return None


def gpt_oss_missing(m, moe) -> Optional[str]:
    """What gpt-oss lacks to hold ``m`` (its every piece is fixed: sinks, biases, the clamped SwiGLU)."""
    wants = [("--softmax-type learnable", m.softmax_type == "learnable"),
             ("--activation quick_geglu", m.activation == "quick_geglu"),
             ("--glu-linear-offset 1", m.glu_linear_offset == 1.0),
             ("--activation-func-clamp-value", m.activation_func_clamp_value is not None),
             ("--add-bias-linear", m.add_bias_linear), ("--moe-router-bias", moe.moe_router_bias),
             ("RoPE and RMSNorm", uses_rope(m) and m.normalization == "RMSNorm" and m.norm_position == "pre"),
             ("every layer a mixture of experts", all(moe_layer_pattern(moe.moe_layer_freq, m.num_layers))),
             ("softmax routing over the top-k logits", moe.moe_router_score_function == "softmax"
              and not moe.moe_router_pre_softmax and not moe.moe_router_enable_expert_bias
              and moe.moe_router_topk_scaling_factor in (None, 1.0) and not moe.moe_router_num_groups),
             ("no shared expert", not moe.moe_shared_expert_intermediate_size)]
    absent = [f for f, ok in wants if not ok]
    others = [f for f in ("qk_layernorm", "add_qkv_bias", "scale_embedding", "attn_logit_softcapping",
                          "final_logit_softcapping", "softmax_scale", "no_rope_freq") if getattr(m, f)]
    if absent:
        return f"gpt_oss needs {absent[0]}"
    return f"{others[0]} (gpt_oss has none)" if others else None


def _dense_missing(m, t: str) -> Optional[str]:
    plain_heads = m.kv_channels * m.num_attention_heads == m.hidden_size and m.num_query_groups == \
        m.num_attention_heads
    if t == "gpt2":
        if (m.position_embedding_type, m.normalization, m.add_bias_linear, m.norm_position) != \
                ("learned_absolute", "LayerNorm", True, "pre") or m.activation not in ("gelu", "gelu_exact"):
            return "GPT-2 has learned positions, LayerNorm, biases and a GELU MLP"
        others = [f for f in ("qk_layernorm", "window_size", "scale_embedding", "attn_logit_softcapping",
                              "final_logit_softcapping", "softmax_scale") if getattr(m, f)]
        return "heads of hidden / heads channels, no grouped-query attention" if not plain_heads else \
            (f"{others[0]} (not in GPT-2)" if others else None)
    if not uses_rope(m) or m.normalization != "RMSNorm" or m.add_bias_linear:
        return f"{t} has RoPE, RMSNorm and no linear biases"
    if m.use_rope_scaling and m.rotary_seq_len_interpolation_factor:
        return "LLaMA-3 RoPE scaling and linear interpolation at once"
    return _llama_family(m, t)


def arch_of(m, moe=None) -> str:
    """The transformers model_type an export of ModelConfig ``m`` (with MoEConfig ``moe``) writes;
    ConfigError naming what is missing when none holds it."""
    if m.hf_model_type:
        why = missing(m, m.hf_model_type, moe)
        if why:
            raise ConfigError(f"--hf-model-type {m.hf_model_type} cannot hold this model: {why}")
        return m.hf_model_type
    reasons = []
    experts = bool(moe is not None and moe.num_experts)
    hybrid = bool(getattr(m, "hybrid_layer_pattern", None))
    linear = bool(getattr(m, "experimental_attention_variant", None)  # Qwen3-Next's Gated DeltaNet
                  or getattr(m, "attention_output_gate", False))  # or gated attention
    qwen3_next = (hf_qwen3next.KIND,)
    for t in HYBRID_ARCHS if hybrid else (qwen3_next if linear else (MOE_ORDER if experts else AUTO_ORDER)):
        why = missing(m, t, moe)
        if why is None:
            return t
        reasons.append(f"{t}: {why}")
    shown = reasons if experts or hybrid or linear else reasons[1:4]
    raise ConfigError("no transformers architecture holds this model (" + "; ".join(shown) + "; ...)")


# ---- the transformers config ------------------------------------------------------------------
def rope_parameters(m) -> Dict[str, Any]:
    out: Dict[str, Any] = {"rope_type": "default", "rope_theta": m.rotary_base}
    if m.use_rope_scaling:
        out.update(rope_type="llama3", factor=m.rope_scaling_factor,
                   low_freq_factor=m.rope_scaling_low_freq_factor,
                   high_freq_factor=m.rope_scaling_high_freq_factor,
                   original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings)
    elif m.rotary_seq_len_interpolation_factor:
        out.update(rope_type="linear", factor=m.rotary_seq_len_interpolation_factor)
    elif m.dynamic_rope_scaling_factor:
        out.update(rope_type="dynamic", factor=m.dynamic_rope_scaling_factor)
    elif m.position_embedding_type == "yarn":
        out.update(rope_type="yarn", factor=m.rotary_scaling_factor,
                   original_max_position_embeddings=m.yarn_original_max_position_embeddings,
                   beta_fast=m.yarn_beta_fast, beta_slow=m.yarn_beta_slow,
                   truncate=m.yarn_correction_range_round_to_int)
        if m.mscale and m.mscale_all_dim:
            out.update(mscale=m.mscale, mscale_all_dim=m.mscale_all_dim)
        else:  # transformers then uses 0.1 ln(factor) + 1: give Megatron-LM's factor explicitly
            out["attention_factor"] = yarn_mscale(m.rotary_scaling_factor, m.mscale)
    return out


def _gpt2_config(m):
    from transformers import GPT2Config
    eod = 50256 if m.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    out = GPT2Config(vocab_size=m.vocab_size, n_positions=m.max_position_embeddings, n_embd=m.hidden_size,
                     n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size,
                     activation_function="gelu_new" if m.activation == "gelu" else "gelu",
                     layer_norm_epsilon=m.norm_epsilon, resid_pdrop=m.hidden_dropout,
                     embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
                     initializer_range=m.init_method_std,
                     tie_word_embeddings=not m.untie_embeddings_and_output_weights,
                     bos_token_id=eod, eos_token_id=eod)
    out.architectures = ["GPT2LMHeadModel"]
    return out


CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
           "gemma2": "Gemma2", "gemma3_text": "Gemma3Text", "phi3": "Phi3", "olmo2": "Olmo2",
           "smollm3": "SmolLM3", "mixtral": "Mixtral", "gpt_oss": "GptOss", "llama4_text": "Llama4Text",
           "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe", "glm4_moe": "Glm4Moe",
           "deepseek_v3": "DeepseekV3"}


def _window_settings(m, t: str) -> Dict[str, Any]:
    flags = windowed_layers(m)
    width = m.window_size[0] + 1 if any(flags) else None
    if t in WHOLE_WINDOW:
        out = dict(sliding_window=width)
        return dict(out, use_sliding_window=width is not None) if t == "qwen3_moe" else out
    if t not in LAYER_TYPES:
        return {}
    types = ["sliding_attention" if f else "full_attention" for f in flags]
    out: Dict[str, Any] = dict(layer_types=types, sliding_window=width or 4096)
    if t not in SANDWICH + ("gpt_oss",):
        out["use_sliding_window"] = width is not None
    return out


def _family_settings(m, t: str) -> Dict[str, Any]:
    """The architecture's own fields."""
    out: Dict[str, Any] = _window_settings(m, t)
    if t in GEMMA:
        out.update(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                   head_dim=m.kv_channels)
    if t == "gemma3_text":
        out["use_bidirectional_attention"] = False
    if t in SANDWICH:
        out.update(attn_logit_softcapping=m.attn_logit_softcapping,
                   final_logit_softcapping=m.final_logit_softcapping,
                   query_pre_attn_scalar=_pre_attn_scalar(m))
    if t in ("smollm3", "llama4_text"):
        rope = [True] * m.num_layers if m.no_rope_freq is None else \
            [not f for f in layer_flags(m.no_rope_freq, m.num_layers)]
        out["no_rope_layers"] = [int(r) for r in rope]
    if t == "llama4_text":  # the dense layers' width; chunks on the RoPE layers (MoE fields: _moe_config)
        out.update(intermediate_size_mlp=m.ffn_hidden_size, use_qk_norm=m.qk_l2_norm,
                   attention_chunk_size=m.attention_chunk_size,
                   layer_types=["chunked_attention" if r and m.attention_chunk_size else "full_attention"
                                for r in out["no_rope_layers"]],
                   attn_temperature_tuning=m.attn_temperature_tuning,
                   floor_scale=int(m.attn_temperature_floor_scale), attn_scale=m.attn_temperature_scale)
    if t == "deepseek_v3":
        out.update(deepseek_fields(m))
    if t == "glm4_moe":
        out.update(use_qk_norm=m.qk_layernorm, attention_bias=m.add_qkv_bias,
                   num_nextn_predict_layers=m.mtp_num_layers or 0)
    if t == "phi3":
        out.update(resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout,
                   original_max_position_embeddings=m.max_position_embeddings)
    return out


def _pre_attn_scalar(m):
    """Gemma 2's ``query_pre_attn_scalar`` (the score scale is its -1/2 power)."""
    if m.softmax_scale is None:
        return m.kv_channels
    value = m.softmax_scale ** -2
    return int(round(value)) if abs(value - round(value)) < 1e-6 * value else value


def hf_config_from(cfg):
    """A ``transformers`` config for a megazero config (the architecture :func:`arch_of` picks)."""
    import transformers
    m, moe = cfg.model, getattr(cfg, "moe", None)
    t = arch_of(m, moe)
    if t == "gpt2":
        return _gpt2_config(m)
    if t in HYBRID_ARCHS:
        return hybrid_config(m, t, moe)
    if t == hf_qwen3next.KIND:
        return hf_qwen3next.hf_config(m, moe)
    cls = getattr(transformers, f"{CLASSES[t]}Config")
    max_pos = m.max_position_embeddings if m.dynamic_rope_scaling_factor else \
        max(m.max_position_embeddings, m.seq_length)
    experts = t in ("mixtral", "olmoe", "gpt_oss") or (t == "llama4_text" and bool(moe and moe.num_experts))
    ffn = moe.moe_ffn_hidden_size if experts else m.ffn_hidden_size
    extra = _moe_config(moe, m, t) if t in MOE_ORDER else {}
    out = cls(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=ffn, **extra,
              num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
              num_key_value_heads=m.num_query_groups, max_position_embeddings=max_pos,
              rms_norm_eps=m.norm_epsilon, rope_parameters=_rope_of(m, t),
              attention_dropout=m.attention_dropout, initializer_range=m.init_method_std,
              tie_word_embeddings=not m.untie_embeddings_and_output_weights, **_family_settings(m, t))
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):  # class defaults beyond this vocabulary
        value = getattr(out, field, None)
        if field == "pad_token_id" or not isinstance(value, int) or value >= m.vocab_size:
            setattr(out, field, None)
    out.head_dim = m.kv_channels  # read where the architecture allows it (default hidden / heads)
    if t == "deepseek_v3":  # its rotary tables' size
        out.head_dim = m.qk_pos_emb_head_dim
    if t not in GEMMA:
        out.hidden_act = "silu"
    named = {"gemma3_text": "Gemma3ForCausalLM", "llama4_text": "Llama4ForCausalLM"}
    out.architectures = [named.get(t, f"{CLASSES[t]}ForCausalLM")]
    return out


def _rope_of(m, t: str) -> Dict[str, Any]:
    """``rope_parameters``: one dict, or Gemma 3's per layer type (its windowed layers' plain base)."""
    if t == "deepseek_v3":
        return deepseek_rope(m, rope_parameters)
    if t != "gemma3_text":
        out = rope_parameters(m)
        return dict(out, partial_rotary_factor=m.rotary_percent) if m.rotary_percent != 1.0 else out
    local = {"rope_type": "default", "rope_theta": m.rotary_base_local} if m.rotary_base_local else \
        rope_parameters(m)
    return {"full_attention": rope_parameters(m), "sliding_attention": local}


def _moe_config(moe, m, t: str) -> Dict[str, Any]:
    """The MoE fields of architecture ``t`` (the inverse of :func:`models.hf_config.moe_settings`)."""
    if t == "llama4_text":  # its moe_layers, [] for a dense model
        return hf_llama4.export_fields(moe, m)
    if t in SIGMOID_MOE:
        return export_fields(moe, m)
    flags = moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
    coeff = moe.moe_aux_loss_coeff if moe.moe_router_load_balancing_type != "none" else 0.0
    out: Dict[str, Any] = dict(num_experts_per_tok=moe.moe_router_topk, output_router_logits=bool(coeff))
    if coeff:
        out["router_aux_loss_coef"] = coeff
    out["num_local_experts" if t in ("mixtral", "qwen3_moe", "gpt_oss") else "num_experts"] = moe.num_experts
    if t == "mixtral":
        return dict(out, router_jitter_noise=0.0)
    if t == "gpt_oss":
        return dict(out, swiglu_limit=m.activation_func_clamp_value, attention_bias=True)
    out["norm_topk_prob"] = not moe.moe_router_pre_softmax
    if t in ("qwen2_moe", "qwen3_moe"):
        out.update(moe_intermediate_size=moe.moe_ffn_hidden_size, decoder_sparse_step=1,
                   mlp_only_layers=[i for i, f in enumerate(flags) if not f])
    if t == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
                   qkv_bias=m.add_qkv_bias)
    if t == "olmoe":
        out["clip_qkv"] = None
    return out
