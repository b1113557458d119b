"""Hugging Face configs and megazero's ModelConfig, both ways, for the architectures megazero reproduces
exactly: GPT-2, LLaMA (LLaMA-3.x ``rope_scaling`` of the ``llama3`` and ``linear`` types included),
Qwen2 / Qwen2.5 (LLaMA with biases on the query, key and value projections) and Mistral without a
sliding window (a LLaMA; exported as one).

Anything else is refused by name: :class:`ConfigError` naming the Hugging Face field, its value and
what megazero supports.
"""
from __future__ import annotations

from typing import Any, Dict

from megazero.config import ConfigError

GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}  # HF -> megazero
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def _unsupported(field: str, value, fix: str):
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def config_from_hf(hf_config) -> Dict[str, Any]:
    """ModelConfig field overrides equivalent to a ``GPT2Config``, ``LlamaConfig``, ``Qwen2Config``
    or ``MistralConfig``; :class:`ConfigError` naming the field for anything megazero does not
    implement (rope scaling of other types, sliding windows, LLaMA's attention/MLP biases, other
    activations, ...)."""
    kind = getattr(hf_config, "model_type", None)
    if kind == "gpt2":
        return _gpt2_settings(hf_config)
    if kind in LLAMA_FAMILY:
        return _llama_settings(hf_config, kind)
    raise ConfigError(f"unsupported Hugging Face config: model_type={kind!r}; megazero imports "
                      f"{', '.join(repr(k) for k in ('gpt2',) + LLAMA_FAMILY)}")


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


def _no_sliding_window(c, kind: str) -> None:
    """Qwen2 and Mistral may attend within a sliding window only: refused unless it cannot act."""
    if kind == "qwen2":
        sliding = [i for i, t in enumerate(getattr(c, "layer_types", None) or []) if t == "sliding_attention"]
        if getattr(c, "use_sliding_window", False) or sliding:
            _unsupported("use_sliding_window", True, "sliding-window attention is not implemented (full "
                         "causal attention only)")
    window = getattr(c, "sliding_window", None)
    if kind == "mistral" and window is not None and window < c.max_position_embeddings:
        _unsupported("sliding_window", window, "sliding-window attention is not implemented; a Mistral with "
                     f"sliding_window null (or >= max_position_embeddings {c.max_position_embeddings}) "
                     "imports as a LLaMA")


def rope_settings(c) -> Dict[str, Any]:
    """``rotary_base`` and the RoPE scaling fields of a LLaMA-family config's ``rope_parameters``
    (``rope_scaling`` in older transformers)."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = dict(rotary_base=float(rope.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0)))
    if kind == "llama3":
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                   rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(
                       rope["original_max_position_embeddings"]))
    elif kind == "linear":
        out.update(rotary_seq_len_interpolation_factor=float(rope["factor"]))
    elif kind != "default":
        _unsupported("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"},
                     "megazero implements plain RoPE and the 'llama3' and 'linear' rope_type")
    return out


def _llama_settings(c, kind: str) -> Dict[str, Any]:
    if c.hidden_act != "silu":
        _unsupported("hidden_act", c.hidden_act, "megazero's LLaMA uses silu (SwiGLU)")
    if kind == "llama":
        for field in ("attention_bias", "mlp_bias"):
            if getattr(c, field, False):
                _unsupported(field, True, "megazero's LLaMA has no linear biases (Qwen2's QKV-only bias is "
                             "supported)")
    _no_sliding_window(c, kind)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                num_attention_heads=c.num_attention_heads,
                num_query_groups=c.num_key_value_heads or c.num_attention_heads, kv_channels=head_dim,
                ffn_hidden_size=c.intermediate_size, vocab_size=c.vocab_size,
                max_position_embeddings=c.max_position_embeddings, seq_length=c.max_position_embeddings,
                norm_epsilon=c.rms_norm_eps, position_embedding_type="rope", normalization="RMSNorm",
                activation="swiglu", add_bias_linear=False, add_qkv_bias=kind == "qwen2",
                untie_embeddings_and_output_weights=not c.tie_word_embeddings, hidden_dropout=0.0,
                attention_dropout=getattr(c, "attention_dropout", 0.0), init_method_std=c.initializer_range,
                **rope_settings(c))


def arch_of(m) -> str:
    """'gpt2', 'llama' or 'qwen2' for a ModelConfig; ConfigError if none matches exactly."""
    feats = (m.position_embedding_type, m.normalization, m.activation, m.add_bias_linear)
    heads = m.num_attention_heads
    plain_heads = m.kv_channels * heads == m.hidden_size and m.num_query_groups == heads
    gelu = m.activation in ("gelu", "gelu_exact")
    plain_rope = not (m.use_rope_scaling or m.rotary_seq_len_interpolation_factor)
    if feats[:2] + feats[3:] == ("learned_absolute", "LayerNorm", True) and gelu and plain_heads:
        return "gpt2"
    if feats == ("rope", "RMSNorm", "swiglu", False):
        if m.use_rope_scaling and m.rotary_seq_len_interpolation_factor:
            raise ConfigError("no transformers config holds LLaMA-3 RoPE scaling and linear interpolation at "
                              "once (--use-rope-scaling with --rotary-seq-len-interpolation-factor)")
        return "qwen2" if m.add_qkv_bias else "llama"
    raise ConfigError(f"no transformers architecture matches (position_embedding_type, normalization, "
                      f"activation, add_bias_linear) = {feats}{'' if plain_rope else ' with RoPE scaling'}; "
                      "GPT-2, LLaMA and Qwen2 layouts are supported")


def _rope_parameters(m) -> Dict[str, Any]:
    out: Dict[str, Any] = {"rope_type": "default", "rope_theta": m.rotary_base}
    if m.use_rope_scaling:
        out.update(rope_type="llama3", factor=m.rope_scaling_factor,
                   low_freq_factor=m.rope_scaling_low_freq_factor,
                   high_freq_factor=m.rope_scaling_high_freq_factor,
                   original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings)
    elif m.rotary_seq_len_interpolation_factor:
        out.update(rope_type="linear", factor=m.rotary_seq_len_interpolation_factor)
    return out


def hf_config_from(cfg):
    """A ``transformers`` config (GPT2Config, LlamaConfig or Qwen2Config) for a megazero config."""
    if getattr(cfg, "moe", None) is not None and cfg.moe.num_experts:
        raise ConfigError("a mixture of experts (--num-experts) does not convert to transformers yet "
                          "(Mixtral / Qwen2-MoE export is not implemented)")
    m, arch = cfg.model, arch_of(cfg.model)
    if arch == "gpt2":
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
    from transformers import LlamaConfig, Qwen2Config
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_query_groups,
                  max_position_embeddings=max(m.max_position_embeddings, m.seq_length),
                  rms_norm_eps=m.norm_epsilon, rope_parameters=_rope_parameters(m), hidden_act="silu",
                  attention_dropout=m.attention_dropout, initializer_range=m.init_method_std,
                  tie_word_embeddings=not m.untie_embeddings_and_output_weights)
    if arch == "qwen2":
        out = Qwen2Config(use_sliding_window=False, **common)
        out.head_dim = m.kv_channels  # Qwen2 reads it when present (default hidden / heads)
        out.architectures = ["Qwen2ForCausalLM"]
    else:
        out = LlamaConfig(head_dim=m.kv_channels, **common)
        out.architectures = ["LlamaForCausalLM"]
    return out
