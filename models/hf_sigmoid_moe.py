"""The DeepSeek-V3-style mixture of experts of transformers' ``Glm4Moe`` (GLM-4.5) and ``DeepseekV3``
both ways: sigmoid scores, an expert bias moving the choice only (``e_score_correction_bias``:
``--moe-router-enable-expert-bias``), group-limited routing (``n_group``, ``topk_group``; a group's
score is the sum of its two best scores: ``--moe-router-group-score-topk 2``), the chosen weights
normalised (``norm_topk_prob``; megazero normalises whenever top-k > 1) and scaled
(``routed_scaling_factor``), an ungated shared expert of ``n_shared_experts`` experts' width, and
``first_k_dense_replace`` dense first layers.  Neither model has a load-balancing loss: an import
trains without one (``--moe-router-load-balancing-type none``), an export leaves one out.

:func:`import_settings` maps a config to megazero's MoE settings (refusing by name what differs);
:func:`export_missing` says what such an architecture lacks to hold a megazero model;
:func:`export_fields` writes the config fields back.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from megazero.config import ConfigError
from megazero.moe.settings import moe_layer_pattern

KINDS = ("glm4_moe", "deepseek_v3")
GROUP_SCORE_TOPK = 2  # transformers sums a group's two best scores


def _refuse(field: str, value, fix: str):
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def import_settings(c, kind: str) -> Dict[str, Any]:
    """megazero's MoE settings of a ``Glm4MoeConfig`` or ``DeepseekV3Config``."""
    experts, topk, layers = int(c.n_routed_experts), int(c.num_experts_per_tok), c.num_hidden_layers
    dense = int(c.first_k_dense_replace)
    if not experts or dense >= layers:
        _refuse("first_k_dense_replace", dense, f"a {kind} config without MoE layers is not imported")
    if int(c.n_shared_experts or 0) < 1:
        _refuse("n_shared_experts", c.n_shared_experts,
                "megazero's DeepSeek-style layers have a shared expert")
    moe_layers = "1" if not dense else "[" + ",".join(["0"] * dense + ["1"] * (layers - dense)) + "]"
    return dict(routing_settings(c, experts, topk, int(c.moe_intermediate_size) * int(c.n_shared_experts)),
                moe_layer_freq=moe_layers)


def routing_settings(c, experts: int, topk: int, shared: int) -> Dict[str, Any]:
    """megazero's settings of the sigmoid router in transformers' config ``c`` (GLM-4.5's, DeepSeek-V3's,
    Nemotron-H's), of ``experts`` experts of ``c.moe_intermediate_size``, top-``topk``, and a shared expert
    ``shared`` wide: the expert bias, the group-limited routing, the scaling; refuses by name what
    megazero's router does not compute."""
    if bool(c.norm_topk_prob) != (topk > 1):
        _refuse("norm_topk_prob", c.norm_topk_prob, "megazero normalises the chosen sigmoid weights "
                "exactly when --moe-router-topk > 1")
    groups, group_topk = int(c.n_group or 1), int(c.topk_group or 1)
    if experts % groups or (groups > 1 and experts // groups < GROUP_SCORE_TOPK):
        _refuse("n_group", groups, f"groups of at least {GROUP_SCORE_TOPK} experts dividing n_routed_experts")
    out: Dict[str, Any] = dict(
        num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=int(c.moe_intermediate_size),
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=shared)
    if float(c.routed_scaling_factor) != 1.0:
        out["moe_router_topk_scaling_factor"] = float(c.routed_scaling_factor)
    if groups > 1:
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk,
                   moe_router_group_score_topk=GROUP_SCORE_TOPK)
    return out


def export_missing(moe, m, t: str) -> Optional[str]:
    """What ``t`` (glm4_moe or deepseek_v3) lacks to hold the experts of MoEConfig ``moe``."""
    if moe.moe_router_score_function != "sigmoid":
        return f"--moe-router-score-function {moe.moe_router_score_function} ({t}: sigmoid)"
    if moe.moe_router_bias:
        return f"--moe-router-bias ({t}'s router has no bias)"
    flags = moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
    dense = flags.index(True) if any(flags) else len(flags)
    if not all(flags[dense:]):
        return f"--moe-layer-freq {moe.moe_layer_freq} ({t}: dense first layers, then every layer MoE)"
    shared, width = moe.moe_shared_expert_intermediate_size, moe.moe_ffn_hidden_size
    if not shared or shared % width or moe.moe_shared_expert_gate:
        return f"--moe-shared-expert-intermediate-size {shared} ({t}: an ungated shared expert, a " \
               f"multiple of --moe-ffn-hidden-size {width})"
    if moe.moe_router_num_groups and moe.moe_router_group_score_topk != GROUP_SCORE_TOPK and \
            moe.moe_router_topk // moe.moe_router_group_topk != GROUP_SCORE_TOPK:
        return f"a group's score of other than its {GROUP_SCORE_TOPK} best experts, " \
               f"--moe-router-group-score-topk ({t} sums {GROUP_SCORE_TOPK})"
    return None  # a load-balancing loss, a z-loss or a capacity are training settings: not written


def export_fields(moe, m) -> Dict[str, Any]:
    """The config fields of the MoE part (:func:`import_settings`' inverse); a model without an expert
    bias exports a zero ``e_score_correction_bias`` (transformers initialises it so), the same routing."""
    flags = moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
    groups = moe.moe_router_num_groups or 1
    return dict(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.moe_router_topk,
                moe_intermediate_size=moe.moe_ffn_hidden_size,
                n_shared_experts=moe.moe_shared_expert_intermediate_size // moe.moe_ffn_hidden_size,
                first_k_dense_replace=flags.index(True), n_group=groups,
                topk_group=moe.moe_router_group_topk if groups > 1 else 1,
                norm_topk_prob=moe.moe_router_topk > 1,
                routed_scaling_factor=moe.moe_router_topk_scaling_factor or 1.0)
