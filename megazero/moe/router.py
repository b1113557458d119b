"""The top-k router of an MoE layer: its weight, the routing, capacity, and the auxiliary losses.

``TopKRouter(cfg, mesh, layer_idx, stats, device)`` holds ``weight [E, hidden]`` (with
``--moe-router-bias`` also ``bias [E]``, gpt-oss's; replicated; marked
``sequence_parallel`` under sequence parallelism, where each tensor-parallel rank routes its own part of
the sequence) and, with ``--moe-router-enable-expert-bias``, ``expert_bias [E]`` (fp32 whatever the
model's dtype, no gradient: :func:`update_expert_bias` moves it after each step), both created by
:func:`~megazero.tensor_parallel.deferred.new_param` (deferred when built on the meta device).

``forward(x [s, b, hidden]) -> (probs [T, E], routing_map [T, E])`` for the ``T = s * b`` tokens this
rank holds, logits in fp32 (float64 for a float64 input).  Everything that needs more tokens than this
rank's is computed over the tokens of one micro-batch, i.e. over the ``tp x cp`` ranks that split its
sequences (``tp`` only under sequence parallelism), so every layout computes what one process does:

- tokens per expert of the load-balancing losses (all-reduced over ``tp x cp``), each rank's loss is its
  share of the micro-batch's (the shares add up to it);
- capacity (``--moe-expert-capacity-factor``): ``ceil(factor x k x T / E)`` of the micro-batch's ``T``
  tokens, decided on the routing of all of them (all-gathered over ``tp x cp``, in sequence order).
  Expert parallelism never changes which tokens compete: routing happens before dispatch.

The losses' gradients follow the language-model loss's conventions: under context parallelism each
rank's share is multiplied by the CP size (the gradient reduction averages over dp x cp, as
:mod:`megazero.context_parallel.loss` explains).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megazero.context_parallel import cp_positions
from megazero.process.distributed import all_gather_single
from megazero.moe.routing import (apply_capacity, aux_loss_scores, expert_capacity, score_dtype,
                                  seq_aux_loss, switch_aux_loss, topk_routing, z_loss)
from megazero.moe.stats import MoEStats, attach_loss
from megazero.tensor_parallel.deferred import new_param
from megazero.tensor_parallel.layers import init_full


class TopKRouter(nn.Module):
    """See the module docstring."""

    def __init__(self, cfg, mesh, layer_idx: int, stats: MoEStats, device=None):
        super().__init__()
        moe, m = cfg.moe, cfg.model
        self.cfg, self.mesh, self.layer_idx, self.stats = moe, mesh, layer_idx, stats
        self.sequence_parallel = cfg.parallel.sequence_parallel and mesh.size("tp") > 1
        device = device if device is not None else mesh.device
        shape = (moe.num_experts, m.hidden_size)  # values bound now: the init may run later (deferred)
        self.weight = new_param(shape, partial(init_full, shape, cfg.training.seed, layer_idx,
                                               "mlp.router.weight", m.init_method_std), device)
        self.weight.sequence_parallel = self.sequence_parallel
        self.bias = None
        if moe.moe_router_bias:  # gpt-oss: a learned bias on the logits, replicated like the weight
            zeros = partial(torch.zeros, moe.num_experts, device="cpu")
            self.bias = new_param((moe.num_experts,), zeros, device)
            self.bias.sequence_parallel = self.sequence_parallel
        self.expert_bias = None
        if moe.moe_router_enable_expert_bias:
            zeros = partial(torch.zeros, moe.num_experts, device="cpu")
            self.expert_bias = new_param((moe.num_experts,), zeros, device).requires_grad_(False)
            self.expert_bias.fixed_dtype = torch.float32  # fp32 whatever the model's dtype (_apply)

    def _apply(self, fn, recurse=True):
        """Module conversions (``.to(bf16)``) keep the expert bias in fp32 (Megatron-LM does the same)."""
        bias = self.expert_bias.data if self.expert_bias is not None else None
        out = super()._apply(fn, recurse)
        if bias is not None:
            self.expert_bias.data = bias.to(self.expert_bias.device, torch.float32)
        return out

    # ---- the tokens of one micro-batch ---------------------------------------------------
    def _split(self):
        """``(group, size, rank)`` of the ranks splitting this micro-batch's tokens (tp x cp under
        sequence parallelism, cp otherwise)."""
        axes = ("tp", "cp") if self.sequence_parallel else ("cp",)
        return self.mesh.group(*axes), self.mesh.size(*axes), self.mesh.coord(*axes)

    def _sum_over_split(self, t: torch.Tensor) -> torch.Tensor:
        group, size, _ = self._split()
        if size > 1:
            t = t.clone()
            dist.all_reduce(t, group=group)
        return t

    def _token_keys(self, s: int, b: int, device) -> torch.Tensor:
        """Sequence-major global index (position x b + sequence) of each of this rank's tokens."""
        tp = self.mesh.size("tp") if self.sequence_parallel else 1
        cp, cp_rank = self.mesh.size("cp"), self.mesh.coord("cp")
        local = s * tp  # this CP rank's positions
        pos = cp_positions(local * cp, cp, cp_rank, device=device) if cp > 1 else \
            torch.arange(local, device=device)
        if tp > 1:
            pos = pos[self.mesh.coord("tp") * s:][:s]
        return (pos.unsqueeze(1) * b + torch.arange(b, device=device)).reshape(-1)

    def _capacity(self, probs, routing_map, s: int, b: int):
        """Drop (and pad) over the micro-batch's tokens; returns this rank's rows."""
        moe = self.cfg
        group, size, rank = self._split()
        local = probs.shape[0]
        packed = torch.cat([probs.detach(), routing_map.to(probs.dtype),
                            self._token_keys(s, b, probs.device).to(probs.dtype).unsqueeze(1)], dim=1)
        if size > 1:
            full = torch.empty((size * local, packed.shape[1]), dtype=packed.dtype, device=packed.device)
            all_gather_single(full, packed.contiguous(), group=group)
            packed = full
        order = torch.argsort(packed[:, -1])
        e = probs.shape[1]
        cap = expert_capacity(packed.shape[0], e, moe.moe_router_topk, moe.moe_expert_capacity_factor)
        p_all, m_all = packed[order, :e], packed[order, e:2 * e] > 0.5
        _, kept, final = apply_capacity(p_all, m_all, cap, moe.moe_token_drop_policy,
                                        moe.moe_pad_expert_input_to_capacity)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        mine = inverse[rank * local:(rank + 1) * local]
        kept, final = kept[mine], final[mine]
        return probs * kept, kept, final

    # ---- losses ------------------------------------------------------------------------
    def _z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """The z-loss share of this rank's tokens, attached to the logits and recorded."""
        _, split, _ = self._split()
        share = z_loss(logits) / split  # the micro-batch's mean is the sum of the shares
        self.stats.record(self.layer_idx, z_loss=share)
        return attach_loss(logits, share * (self.cfg.moe_z_loss_coeff * self.mesh.size("cp")), self.stats)

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, s: int, b: int) -> torch.Tensor:
        """The load-balancing loss share of this rank's tokens (counts over the micro-batch), attached
        to the probs and recorded."""
        moe = self.cfg
        kind, coeff, k = moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff, moe.moe_router_topk
        if kind not in ("aux_loss", "seq_aux_loss") or not coeff:
            return probs
        _, split, _ = self._split()
        scores, top = aux_loss_scores(logits, k, moe.moe_router_score_function)
        if kind == "aux_loss":
            counts = self._sum_over_split(top.sum(dim=0).to(scores.dtype))
            share = switch_aux_loss(scores, counts, logits.shape[0] * split, k)
        else:
            counts = self._sum_over_split(top.view(s, b, -1).sum(dim=0).to(scores.dtype))
            share = seq_aux_loss(scores.view(s, b, -1), counts, s * split, k)
        self.stats.record(self.layer_idx, aux_loss=share)
        return attach_loss(probs, share * (coeff * self.mesh.size("cp")), self.stats)

    def forward(self, x: torch.Tensor):
        moe = self.cfg
        s, b, _ = x.shape
        dt = score_dtype(x)
        bias = self.bias.to(dt) if self.bias is not None else None
        logits = F.linear(x.to(dt), self.weight.to(dt), bias).reshape(s * b, -1)
        training = self.training and torch.is_grad_enabled()
        if training and moe.moe_z_loss_coeff:
            logits = self._z_loss(logits)
        probs, routing_map = topk_routing(logits, moe.moe_router_topk, moe.moe_router_score_function,
                                          moe.moe_router_pre_softmax, moe.moe_router_topk_scaling_factor,
                                          self.expert_bias, moe.moe_router_num_groups,
                                          moe.moe_router_group_topk, moe.moe_router_group_score_topk)
        kept = routing_map
        if moe.moe_expert_capacity_factor is not None:
            probs, kept, routing_map = self._capacity(probs, routing_map, s, b)
        if training:
            probs = self._aux_loss(logits, probs, s, b)
            routed = kept.sum(dim=0)
            dropped = s * b * moe.moe_router_topk - routed.sum()
            self.stats.record(self.layer_idx, tokens=routed, dropped=dropped)
        return probs, routing_map


def update_expert_bias(router: TopKRouter, tokens: torch.Tensor) -> None:
    """After a step: ``expert_bias += rate * sign(mean - tokens)`` with ``tokens [E]`` the tokens each
    expert took in the whole global batch (DeepSeek-V3's aux-loss-free balancing, Megatron-LM's rule)."""
    if router.expert_bias is None:
        return
    with torch.no_grad():
        tokens = tokens.to(router.expert_bias.device, torch.float32)
        router.expert_bias.add_(torch.sign(tokens.mean() - tokens) * router.cfg.moe_router_bias_update_rate)
