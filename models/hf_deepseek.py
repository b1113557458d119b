"""transformers' ``DeepseekV3`` both ways: multi-latent attention (docs/mla.md) with its latent norms, its
RoPE on interleaved pairs (``rope_interleave``, as megazero's MLA rotates them: no permutation; without
it, halves, whose rows :func:`pairs_getter` interleaves on import), plain
or YaRN (``mscale``, ``mscale_all_dim``), and the DeepSeek-style mixture of experts of
:mod:`models.hf_sigmoid_moe`.  Its multi-token prediction layers are not part of transformers' model
(``num_nextn_predict_layers`` is ignored there) but its published files hold them as
``model.layers.<L + k>.*``: ``convert_hf.py`` (:mod:`models.hf_convert`) imports the depths whose weights
the files hold as ``--mtp-num-layers`` (:data:`MTP_NAMES`), and every export writes them there.

:func:`mla_settings` maps the attention part of a config; :func:`deepseek_missing` says what
``DeepseekV3`` lacks to hold a megazero model; :func:`deepseek_fields` and :func:`deepseek_rope`
write its config fields; and :data:`MLA_NAMES` pairs the attention's tensors.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, Optional

import torch

from megazero.config import ConfigError
from .rope import yarn_mscale

LATENT_EPS = 1e-6  # transformers' DeepseekV3RMSNorm on the latents keeps its default eps
MLA_NAMES = [("attention.q_down.weight", "self_attn.q_a_proj.weight"),
             ("attention.q_norm.weight", "self_attn.q_a_layernorm.weight"),
             ("attention.q_up.weight", "self_attn.q_b_proj.weight"),
             ("attention.q_proj.weight", "self_attn.q_proj.weight"),
             ("attention.kv_down.weight", "self_attn.kv_a_proj_with_mqa.weight"),
             ("attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"),
             ("attention.kv_up.weight", "self_attn.kv_b_proj.weight")]
# multi-token prediction depth i (megazero's mtp.<i>.*) in DeepSeek-V3's files (model.layers.<i>.*), besides
# its transformer layer's own names and the copies of the embedding and head
# (embed_tokens, shared_head.head)
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "eh_proj.weight": "eh_proj.weight", "final_norm.weight": "shared_head.norm.weight"}
MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
MTP_ARCHS = ("deepseek_v3", "glm4_moe")  # GLM-4.5's files hold its depth the same way


def mtp_depths(hf_names, c) -> int:
    """The multi-token prediction depths of DeepSeek-V3 (or GLM-4.5) config ``c``
    (``num_nextn_predict_layers``) whose weights ``hf_names`` hold (transformers' own model drops them;
    the published files keep them)."""
    if getattr(c, "model_type", None) not in MTP_ARCHS:
        return 0
    names, layers = set(hf_names), c.num_hidden_layers
    wanted = int(getattr(c, "num_nextn_predict_layers", 0) or 0)
    present = [f"model.layers.{layers + k}.eh_proj.weight" in names for k in range(wanted)]
    return present.index(False) if False in present else wanted


def _refuse(field: str, value, fix: str):
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def mla_settings(c, rope: Dict[str, Any]) -> Dict[str, Any]:
    """The multi-latent attention settings of a ``DeepseekV3Config`` whose RoPE settings are ``rope``
    (:func:`models.hf_config.rope_settings`: plain, or ``position_embedding_type`` yarn)."""
    if c.num_key_value_heads != c.num_attention_heads:
        _refuse("num_key_value_heads", c.num_key_value_heads,
                "multi-latent attention has no key/value groups")
    if float(c.rms_norm_eps) != LATENT_EPS:
        _refuse("rms_norm_eps", c.rms_norm_eps, f"transformers' DeepSeek-V3 normalises its latents with eps "
                f"{LATENT_EPS} and megazero with --norm-epsilon, so only {LATENT_EPS} imports exactly")
    yarn = rope.get("position_embedding_type") == "yarn"
    return dict(multi_latent_attention=True, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim,
                v_head_dim=c.v_head_dim, qk_layernorm=True, qk_layernorm_scope="head",
                num_query_groups=c.num_attention_heads, position_embedding_type="rope",
                rope_type="yarn" if yarn else "rope")


def pairs_getter(get: Callable[[str], torch.Tensor], c) -> Callable[[str], torch.Tensor]:
    """``get(hf_name)`` of a DeepSeek-V3 config ``c`` whose RoPE rotates halves (``rope_interleave``
    false), giving the rotary rows of the query and key projections in interleaved pairs, as megazero's
    MLA rotates them: row ``2i`` is the halves' row ``i``, ``2i + 1`` their row ``i + d/2`` (each query
    head's last ``qk_rope_head_dim`` rows, the key latent's last ones).  Scores do not change; the export
    writes the pairs with ``rope_interleave`` true."""
    if getattr(c, "model_type", None) != "deepseek_v3" or getattr(c, "rope_interleave", True):
        return get
    dr, width = c.qk_rope_head_dim, c.qk_nope_head_dim + c.qk_rope_head_dim
    pairs = torch.stack([torch.arange(dr // 2), torch.arange(dr // 2) + dr // 2], -1).flatten()

    def found(name: str) -> torch.Tensor:
        t = get(name)
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            heads = t.reshape(-1, width, *t.shape[1:])
            return torch.cat([heads[:, :width - dr], heads[:, width - dr:][:, pairs]], 1).reshape(t.shape)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            return torch.cat([t[:len(t) - dr], t[len(t) - dr:][pairs]])
        return t
    return found


def deepseek_missing(m) -> Optional[str]:
    """What ``DeepseekV3`` lacks to hold ModelConfig ``m`` apart from its experts (None: nothing)."""
    wants = [("--multi-latent-attention", m.multi_latent_attention),
             ("--qk-layernorm (its latent norms)", m.qk_layernorm),
             ("RMSNorm before each sublayer", m.normalization == "RMSNorm" and m.norm_position == "pre"),
             ("--swiglu", m.activation == "swiglu"), ("no linear biases", not m.add_bias_linear),
             ("RoPE positions only", m.position_embedding_type == "rope"),
             (f"--norm-epsilon {LATENT_EPS} (its latent norms' eps)", m.norm_epsilon == LATENT_EPS)]
    absent = [f for f, ok in wants if not ok]
    if absent:
        return f"deepseek_v3 needs {absent[0]}"
    if m.rope_type == "rope" and yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim) != 1.0:
        return f"--rope-type rope with --rotary-scaling-factor {m.rotary_scaling_factor} and " \
               f"--mscale-all-dim {m.mscale_all_dim} (megazero's MLA scales the scores by mscale^2 with " \
               "plain RoPE too, as Megatron-core; deepseek_v3 only with YaRN)"
    others = [f for f in ("window_size", "scale_embedding", "attn_logit_softcapping",
                          "final_logit_softcapping", "softmax_scale", "no_rope_freq") if getattr(m, f)]
    return f"{others[0]} (deepseek_v3 has none)" if others else None


def deepseek_rope(m, rope_parameters) -> Dict[str, Any]:
    """``DeepseekV3Config``'s ``rope_parameters``, plain or YaRN; ``rope_parameters(m)`` writes a RoPE
    model's dict."""
    yarn = m.rope_type != "rope"  # YaRN unless --rope-type rope (MLA's default: None is YaRN)
    rope = rope_parameters(replace(m, position_embedding_type="yarn" if yarn else "rope"))
    if yarn and m.mscale_all_dim:  # the score scale reads it (attention_factor: cos/sin)
        rope["mscale_all_dim"] = m.mscale_all_dim
    return rope


def deepseek_fields(m) -> Dict[str, Any]:
    """``DeepseekV3Config``'s attention fields."""
    return dict(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim,
                qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, rope_interleave=True,
                attention_bias=False, num_nextn_predict_layers=m.mtp_num_layers or 0)
