"""Llama 4 (text)'s mixture of experts both ways: transformers' ``Llama4TextMoe``.

Its MoE layers (``moe_layers``, or every ``interleave_moe_layer_step``-th layer; the others are dense MLPs
of ``intermediate_size_mlp``) route each token to one expert (``num_experts_per_tok`` 1) by the top
router logit and weigh the expert's *input* by the sigmoid of that logit, then add an ungated shared
expert of the experts' width (``intermediate_size``): megazero's ``--moe-router-topk 1
--moe-router-score-function sigmoid --moe-apply-probs-on-input --moe-shared-expert-intermediate-size``.
transformers computes no load-balancing loss for it: an import trains without one.

Tensors of a MoE layer ``model.layers.<i>.feed_forward.``: ``router.weight [E, h]``,
``experts.gate_up_proj [E, h, 2F]`` (``x @ W``: gates in the first F columns, ups in the last F),
``experts.down_proj [E, F, h]`` and ``shared_expert.{gate,up,down}_proj.weight``.

:func:`import_settings` maps a config to megazero's MoE settings (refusing by name what differs),
:func:`export_missing` says what Llama 4 lacks to hold a megazero MoE, :func:`export_fields` writes the
config fields; :func:`expert_tensor` and :func:`expert_groups` map the experts' tensors.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from megazero.config import ConfigError
from megazero.moe.settings import moe_layer_pattern

FF = "feed_forward."
LAYER_NAMES = [("mlp.router.weight", FF + "router.weight", ""),  # (megazero, transformers, how) per layer
               ("mlp.shared_experts.gate.weight", FF + "shared_expert.gate_proj.weight", ""),
               ("mlp.shared_experts.fc1.weight", FF + "shared_expert.up_proj.weight", ""),
               ("mlp.shared_experts.fc2.weight", FF + "shared_expert.down_proj.weight", "")]


def _refuse(field: str, value, fix: str):
    raise ConfigError(f"unsupported Hugging Face config: {field}={value!r}; {fix}")


def import_settings(c) -> Dict[str, Any]:
    """megazero's MoE settings of a ``Llama4TextConfig`` with MoE layers (none: a dense model)."""
    layers = c.num_hidden_layers
    moe = sorted(int(i) for i in (c.moe_layers or []))
    if not moe:
        return {}
    if moe[0] < 0 or moe[-1] >= layers:
        _refuse("moe_layers", c.moe_layers,
                f"layer indices between 0 and num_hidden_layers - 1 = {layers - 1}")
    if int(c.num_experts_per_tok) != 1:
        _refuse("num_experts_per_tok", c.num_experts_per_tok, "the routing weight on the expert's input "
                "(--moe-apply-probs-on-input) is top-1 only (Megatron-LM's rule)")
    if float(getattr(c, "router_jitter_noise", 0.0) or 0.0):
        _refuse("router_jitter_noise", c.router_jitter_noise, "jitter on the router's input (Megatron-LM's "
                "--moe-input-jitter-eps) is not implemented")
    flags = [i in moe for i in range(layers)]
    width = int(c.intermediate_size)
    return dict(num_experts=int(c.num_local_experts), moe_router_topk=1, moe_ffn_hidden_size=width,
                moe_layer_freq="1" if all(flags) else "[" + ",".join(str(int(f)) for f in flags) + "]",
                moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_apply_probs_on_input=True, moe_shared_expert_intermediate_size=width,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


def export_missing(moe, m) -> Optional[str]:
    """What Llama 4 lacks to hold the experts of MoEConfig ``moe`` (None: nothing)."""
    wants = [("--moe-apply-probs-on-input", moe.moe_apply_probs_on_input),
             ("--moe-router-topk 1", moe.moe_router_topk == 1),
             ("--moe-router-score-function sigmoid", moe.moe_router_score_function == "sigmoid"),
             ("no --moe-router-enable-expert-bias", not moe.moe_router_enable_expert_bias),
             ("no --moe-router-bias", not moe.moe_router_bias),
             ("no --moe-router-topk-scaling-factor", moe.moe_router_topk_scaling_factor in (None, 1.0)),
             ("no group-limited routing", not moe.moe_router_num_groups),
             (f"an ungated shared expert of --moe-ffn-hidden-size {moe.moe_ffn_hidden_size}, "
              "--moe-shared-expert-intermediate-size",
              moe.moe_shared_expert_intermediate_size == moe.moe_ffn_hidden_size
              and not moe.moe_shared_expert_gate)]
    absent = [flag for flag, ok in wants if not ok]
    return f"llama4_text's experts need {absent[0]}" if absent else None


def export_fields(moe, m) -> Dict[str, Any]:
    """The MoE config fields (:func:`import_settings`' inverse); a dense model: ``moe_layers []``."""
    if moe is None or not moe.num_experts:
        return dict(moe_layers=[])
    flags = moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
    return dict(moe_layers=[i for i, f in enumerate(flags) if f], num_local_experts=moe.num_experts,
                num_experts_per_tok=1, output_router_logits=False, router_jitter_noise=0.0)


def expert_tensor(get: Callable[[str], torch.Tensor], src: str, e: Optional[int], leaf: str) -> torch.Tensor:
    """megazero's ``fc1`` (up), ``gate`` or ``fc2`` weight of expert ``e`` (all stacked: None) of the layer
    whose tensors start with ``src``."""
    if leaf == "fc2":
        t = get(src + FF + "experts.down_proj")
    else:
        fused = get(src + FF + "experts.gate_up_proj")
        width = fused.shape[-1] // 2
        t = fused[..., :width] if leaf == "gate" else fused[..., width:]
    t = t if e is None else t[e]
    return t.transpose(-1, -2)


def expert_groups(i: str, dst: str, experts: int) -> List:
    """Layer ``i``'s experts as the export groups of :mod:`models.hf` (:func:`expert_tensor`'s inverse)."""
    def names(leaf):
        return [f"decoder.{i}.mlp.experts.{e}.{leaf}_weight" for e in range(experts)]

    def gate_up(*t):  # gates then ups, one [F, h] per expert
        return [torch.stack([torch.cat([g.t(), u.t()], -1) for g, u in zip(t[:experts], t[experts:])])]
    return [(names("gate") + names("fc1"), [dst + FF + "experts.gate_up_proj"], gate_up),
            (names("fc2"), [dst + FF + "experts.down_proj"], lambda *t: [torch.stack([w.t() for w in t])])]
