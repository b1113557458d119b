"""The rules of the attention and activation variants of gpt-oss, Llama 4, Gemma 3 and GLM-4.5
(``--softmax-type``, ``--attention-chunk-size``, ``--qk-l2-norm``, ``--attn-temperature-tuning``,
``--rotary-base-local``, ``--rotary-percent``, ``--glu-linear-offset``, ``--activation-func-clamp-value``),
each a one-line :class:`ConfigError` naming the flag and the fix."""
from __future__ import annotations

from megazero.config.patterns import GATED, layer_flags, uses_rope, windowed_layers
from megazero.errors import ConfigError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _rope_layers(mod):
    if not uses_rope(mod):
        return [False] * mod.num_layers
    if mod.no_rope_freq is None:
        return [True] * mod.num_layers
    return [not f for f in layer_flags(mod.no_rope_freq, mod.num_layers)]


def check_attention_variants(mod) -> None:
    """``mod``: a ModelConfig with its defaults filled in (``kv_channels``) and its patterns checked."""
    mla = getattr(mod, "multi_latent_attention", False)
    _check(mod.softmax_type == "vanilla" or not mla,
           f"--softmax-type {mod.softmax_type} with --multi-latent-attention is not implemented (attention "
           "sinks are in ordinary attention); drop one of them")
    chunk = mod.attention_chunk_size
    if chunk is not None:
        _check(isinstance(chunk, int) and chunk >= 1,
               f"--attention-chunk-size must be a positive integer, got {chunk}")
        _check(any(_rope_layers(mod)) and not mla,
               "--attention-chunk-size acts on the layers that use RoPE (Llama 4): it needs "
               "--position-embedding-type rope or yarn (and ordinary attention)")
    if mod.qk_l2_norm:
        _check(not mod.qk_layernorm, "--qk-l2-norm and --qk-layernorm are two query/key norms; choose one")
        _check(not mla, "--qk-l2-norm with --multi-latent-attention is not implemented (Megatron-LM refuses "
               "it too); drop it")
        _check(mod.qk_l2_norm_scope == "all" or uses_rope(mod),
               "--qk-l2-norm-scope rope normalises the layers that use RoPE: it needs "
               "--position-embedding-type rope or yarn")
    if mod.attn_temperature_tuning:
        rope = _rope_layers(mod)
        _check(any(rope) and not all(rope),
               "--attn-temperature-tuning acts on the layers without RoPE of a RoPE model (Llama 4): give "
               "--position-embedding-type rope and --no-rope-freq")
        _check(mod.attn_temperature_floor_scale > 0, f"--attn-temperature-floor-scale must be > 0, got "
               f"{mod.attn_temperature_floor_scale}")
    _check_rope_parts(mod, mla)
    gated = mod.activation in GATED
    _check(gated or (mod.glu_linear_offset == 0.0 and mod.activation_func_clamp_value is None),
           f"--glu-linear-offset and --activation-func-clamp-value act on gated activations: with "
           f"--activation {mod.activation} use --swiglu or --quick-geglu, or drop them")
    clamp = mod.activation_func_clamp_value
    _check(clamp is None or clamp > 0, f"--activation-func-clamp-value must be > 0, got {clamp}")


def _check_rope_parts(mod, mla: bool) -> None:
    p, local = mod.rotary_percent, mod.rotary_base_local
    _check(0.0 < p <= 1.0, f"--rotary-percent must be in (0, 1], got {p}")
    if p != 1.0:
        _check(uses_rope(mod) and not mla, f"--rotary-percent {p} rotates part of each head: it needs "
               "--position-embedding-type rope or yarn (and ordinary attention)")
        dim = int(mod.kv_channels * p)
        _check(dim >= 2 and dim % 2 == 0, f"--rotary-percent {p} of --kv-channels {mod.kv_channels} gives "
               f"{dim} rotary channels; RoPE needs a positive even number: choose another percentage")
    if local is not None:
        _check(local > 0, f"--rotary-base-local must be > 0, got {local}")
        _check(uses_rope(mod) and not mla and any(windowed_layers(mod)),
               "--rotary-base-local is the RoPE base of the sliding-window layers (Gemma 3): it needs "
               "--position-embedding-type rope and --window-size LEFT,0")
