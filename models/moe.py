"""The mixture-of-experts layer: what replaces the MLP in the layers ``--moe-layer-freq`` names.

``MoELayer(cfg, mesh, layer_idx, stats)``: ``forward(x [s (/tp), b, hidden])`` routes this rank's tokens
(:class:`megazero.moe.TopKRouter`), sends them to their experts and back
(:mod:`megazero.moe.dispatcher`), runs the rank's experts as one grouped product
(:class:`megazero.moe.GroupedExperts`) and adds the shared expert, a dense MLP every token goes through
(``--moe-shared-expert-intermediate-size``), scaled by ``sigmoid(x . shared_gate_weight)`` with
``--moe-shared-expert-gate`` (Qwen2-MoE); with ``--moe-apply-probs-on-input`` the routing weight
scales the expert's input, not its output (Llama 4; :mod:`megazero.moe.dispatcher`).  Parameter names
inside a transformer layer:

=======================================  ======================================================
``mlp.router.weight [E, hidden]``        the router (replicated; ``sequence_parallel`` under SP)
``mlp.router.expert_bias [E]``           with ``--moe-router-enable-expert-bias``: fp32, no grad
``mlp.experts.fc1_weight`` ...           this rank's experts (:mod:`megazero.moe.experts`)
``mlp.shared_experts.fc1.weight`` ...    the shared expert: a dense :class:`~megazero_models.layers.MLP`
``mlp.shared_gate_weight [1, hidden]``   its gate (replicated; ``sequence_parallel`` under SP)
=======================================  ======================================================

Every parameter comes from :func:`~megazero.tensor_parallel.deferred.new_param`, so the layer builds
deferred on the meta device (:func:`megazero.tensor_parallel.deferred.build_chunks`) like a dense one.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megazero.moe import GroupedExperts, MoEStats, TopKRouter, build_dispatcher
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import init_full
from .layers import MLP


class MoELayer(nn.Module):
    """See the module docstring."""

    def __init__(self, cfg, mesh, layer_idx: int, stats: MoEStats, onednn: bool = False):
        super().__init__()
        moe, m = cfg.moe, cfg.model
        # under TP without SP every TP rank holds every token: the forward is exact (generation), but
        # the experts' gradients would count each token once per TP rank: training needs SP (Megatron-LM's
        # rule)
        self.forward_only = mesh.size("tp") > 1 and not cfg.parallel.sequence_parallel
        self.router = TopKRouter(cfg, mesh, layer_idx, stats)
        self.experts = GroupedExperts(cfg, mesh, layer_idx)
        self.dispatcher = build_dispatcher(moe.moe_token_dispatcher_type, mesh, moe.num_experts,
                                           moe.moe_apply_probs_on_input)
        shared = moe.moe_shared_expert_intermediate_size
        self.shared_experts: Optional[MLP] = None
        self.shared_gate_weight = None
        if shared:
            self.shared_experts = MLP(cfg, mesh, layer_idx, onednn, ffn_hidden_size=shared,
                                      prefix="mlp.shared_experts")
            if moe.moe_shared_expert_gate:
                shape = (1, m.hidden_size)  # values bound now: the init may run later (deferred)
                init = partial(init_full, shape, cfg.training.seed, layer_idx, "mlp.shared_gate_weight",
                               m.init_method_std)
                self.shared_gate_weight = new_param(shape, init, mesh.device)
                self.shared_gate_weight.sequence_parallel = cfg.parallel.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_only and torch.is_grad_enabled():
            raise ValueError("MoE layers under --tensor-model-parallel-size > 1 train only with "
                             "--sequence-parallel (without it they run forward only, for generation)")
        probs, routing_map = self.router(x)
        out = self.dispatcher(x.reshape(-1, x.shape[-1]), probs, routing_map, self.experts)
        out = out.to(x.dtype).view_as(x)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate_weight is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_gate_weight))
            out = out + shared
        return out


def moe_mlp(cfg, mesh, layer_idx: int, stats: Optional[MoEStats],
            onednn: bool = False) -> Optional[nn.Module]:
    """The MoE layer for transformer layer ``layer_idx`` when it is one (``stats`` given for a chunk with
    MoE layers), else None (the layer keeps its dense MLP)."""
    if stats is None or layer_idx not in stats.layers:
        return None
    return MoELayer(cfg, mesh, layer_idx, stats, onednn)
