"""The rules of multi-latent attention's settings (``--multi-latent-attention`` and its sizes), each a
one-line :class:`ConfigError` naming the flag and the fix."""
from __future__ import annotations

from megazero.errors import ConfigError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_mla(mod) -> None:
    """``mod``: a ModelConfig whose defaults are filled in (``num_query_groups``)."""
    if not mod.multi_latent_attention:
        _check(mod.rope_type != "yarn", "--rope-type yarn: multi-latent attention's RoPE (Megatron-LM's "
               "rule: ordinary attention takes --rope-type rope only); add --multi-latent-attention, or for "
               "YaRN in ordinary attention use --position-embedding-type yarn")
        return
    for flag, v in (("--kv-lora-rank", mod.kv_lora_rank), ("--qk-head-dim", mod.qk_head_dim),
                    ("--qk-pos-emb-head-dim", mod.qk_pos_emb_head_dim), ("--v-head-dim", mod.v_head_dim)):
        _check(isinstance(v, int) and v >= 1, f"{flag} must be a positive integer with "
               f"--multi-latent-attention, got {v}")
    _check(mod.q_lora_rank is None or (isinstance(mod.q_lora_rank, int) and mod.q_lora_rank >= 1),
           f"--q-lora-rank must be a positive integer (or left out: one query projection), got "
           f"{mod.q_lora_rank}")
    _check(mod.qk_pos_emb_head_dim % 2 == 0, f"--qk-pos-emb-head-dim {mod.qk_pos_emb_head_dim}: RoPE rotates "
           "pairs of channels, so it must be even")
    _check(mod.num_query_groups == mod.num_attention_heads,
           f"--num-query-groups {mod.num_query_groups} with --multi-latent-attention: MLA has no key/value "
           "groups (Megatron-LM refuses --group-query-attention with it); drop --num-query-groups")
    refused = [("--qk-layernorm-scope all", mod.qk_layernorm and mod.qk_layernorm_scope == "all",
                "its --qk-layernorm normalises each latent"),
               ("--add-qkv-bias", mod.add_qkv_bias, "its projections have no biases, as in Megatron-LM"),
               ("--softmax-scale", mod.softmax_scale is not None,
                "its score scale is mscale^2 / sqrt(--qk-head-dim + --qk-pos-emb-head-dim)"),
               ("--no-rope-freq", mod.no_rope_freq is not None, "every MLA layer rotates its rotary part"),
               ("--use-rope-scaling", mod.use_rope_scaling, "its RoPE is --rope-type yarn or rope"),
               ("--rotary-seq-len-interpolation-factor", mod.rotary_seq_len_interpolation_factor is not None,
                "its RoPE is --rope-type yarn or rope"),
               ("--dynamic-rope-scaling-factor", mod.dynamic_rope_scaling_factor is not None,
                "its RoPE is --rope-type yarn or rope")]
    others = [("--softmax-type", getattr(mod, "softmax_type", "vanilla") != "vanilla"),
              ("--attention-chunk-size", getattr(mod, "attention_chunk_size", None) is not None),
              ("--rotary-percent", getattr(mod, "rotary_percent", 1.0) != 1.0),
              ("--rotary-base-local", getattr(mod, "rotary_base_local", None) is not None),
              ("--qk-l2-norm", getattr(mod, "qk_l2_norm", False)),
              ("--attn-temperature-tuning", getattr(mod, "attn_temperature_tuning", False))]
    refused += [(flag, on, "not implemented for multi-latent attention") for flag, on in others]
    for flag, on, why in refused:
        _check(not on, f"{flag} does not apply to --multi-latent-attention ({why}); drop it")
    if mod.rope_type != "rope":  # YaRN, MLA's default
        _check(mod.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be > 0, got "
                                              f"{mod.rotary_scaling_factor}")
        _check(mod.yarn_beta_fast > 0 and mod.yarn_beta_slow > 0,
               f"--yarn-beta-fast {mod.yarn_beta_fast} and --yarn-beta-slow {mod.yarn_beta_slow} must be > 0")
        _check(isinstance(mod.yarn_original_max_position_embeddings, int)
               and mod.yarn_original_max_position_embeddings >= 1,
               "--yarn-original-max-position-embeddings must be a positive integer")
