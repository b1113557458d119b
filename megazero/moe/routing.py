"""The router's arithmetic as plain functions of tensors (no modules, no process groups), each tested
alone against a float64 loop over tokens and experts (``tests/test_moe_pieces.py``).

Routing is kept dense, as in Megatron-core: ``probs [T, E]`` (the weight of expert e in token t's
output, zero where t is not routed to e) and ``routing_map [T, E]`` (bool: t's hidden state goes to e).
Scores are computed in fp32 (float64 for float64 logits).

- :func:`topk_routing`: softmax (after or, with ``pre_softmax``, before the top-k) or sigmoid scores
  (normalised over the top-k when k > 1), times the scaling factor; an expert bias moves only the
  choice (aux-loss-free balancing), never the weights; optionally group-limited
  (:func:`group_limited_topk`: the top-k among the experts of the best ``group_topk`` groups).
- :func:`aux_loss_scores`: the scores the load-balancing loss sees (softmax over all experts; sigmoid
  normalised over all) and their own top-k map.
- :func:`switch_aux_loss`: ``E / (k T^2) * sum_e count_e * sum_t score_te`` (Switch/GShard), where
  ``count_e`` and ``T`` may cover more tokens than the scores do (the other sequence-parallel ranks'
  tokens: the loss is then this rank's share of the whole, and the shares add up to it);
  :func:`seq_aux_loss`: the same per sequence, averaged over the sequences.
- :func:`z_loss`: ``mean_t logsumexp(logits_t)^2``.
- :func:`expert_capacity` and :func:`apply_capacity`: at most ``capacity`` tokens per expert (by
  probability or by position), optionally every expert filled up to exactly ``capacity`` with tokens of
  weight 0.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def score_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32, or float64 for float64 logits (the tests' exact path)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def group_score_topk(topk: int, group_topk: int, override: Optional[int] = None) -> int:
    """Experts whose scores add up to a group's score: ``topk // group_topk`` (Megatron-core's rule; 2 for
    DeepSeek-V3's 8 of 4 groups) unless ``override`` (``--moe-router-group-score-topk``) names it."""
    return override if override else topk // group_topk


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int,
                       per_group: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices) [T, topk]`` of the top-k of ``scores [T, E]`` among the experts of the
    ``group_topk`` best of ``num_groups`` equal, consecutive groups of experts; a group's score is the
    sum of its ``per_group`` best scores (:func:`group_score_topk`).  DeepSeek-V2/V3's device- or
    node-limited routing when the groups are the experts of one EP rank or node."""
    t, e = scores.shape
    per_group = per_group or group_score_topk(topk, group_topk)
    grouped = scores.view(t, num_groups, e // num_groups)
    group_scores = torch.topk(grouped, per_group, dim=-1).values.sum(dim=-1)  # [T, groups]
    chosen = torch.topk(group_scores, group_topk, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    keep = keep.repeat_interleave(e // num_groups, dim=1)
    return torch.topk(scores.masked_fill(~keep, float("-inf")), topk, dim=1)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 scaling_factor: Optional[float] = None,
                 expert_bias: Optional[torch.Tensor] = None, num_groups: Optional[int] = None,
                 group_topk: Optional[int] = None,
                 group_score_experts: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(probs [T, E], routing_map [T, E])`` of ``logits [T, E]`` (Megatron-core's top-k routing); with
    ``num_groups`` and ``group_topk`` the choice is group-limited (:func:`group_limited_topk`, on what
    the plain top-k would rank: the logits, the softmax scores, or the sigmoid scores plus the bias)."""
    dt = score_dtype(logits)
    logits = logits.to(dt)

    def choose(x):
        if num_groups and group_topk:
            return group_limited_topk(x, topk, num_groups, group_topk, group_score_experts)
        return torch.topk(x, topk, dim=1)

    if score_function == "softmax":
        if pre_softmax:
            probs, top = choose(torch.softmax(logits, dim=-1))
        else:
            chosen, top = choose(logits)
            probs = torch.softmax(chosen, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if expert_bias is not None:  # the bias moves the choice only
            top = choose(scores + expert_bias.to(dt)).indices
            probs = torch.gather(scores, 1, top)
        else:
            probs, top = choose(scores)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"--moe-router-score-function must be softmax or sigmoid, got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    dense = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return dense, routing_map


def aux_loss_scores(logits: torch.Tensor, topk: int,
                    score_function: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(scores [T, E], top-k map [T, E])`` the load-balancing losses use (no expert bias, no capacity)."""
    logits = logits.to(score_dtype(logits))
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, topk, dim=1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)


def switch_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int,
                    topk: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (without its coefficient): ``E / (k T^2) * sum_e
    tokens_per_expert_e * sum_t scores_te`` with ``T = total_tokens``; ``scores [T_local, E]`` may be a
    share of the ``T`` tokens counted in ``tokens_per_expert [E]``."""
    num_experts = scores.shape[-1]
    per_expert = scores.sum(dim=0)
    return (per_expert * tokens_per_expert.to(per_expert.dtype)).sum() * (
        num_experts / (topk * total_tokens * total_tokens))


def seq_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, seq_length: int,
                 topk: int) -> torch.Tensor:
    """The load-balancing loss of each sequence, averaged over the sequences (DeepSeek-V2's).

    ``scores [s_local, b, E]`` (this rank's positions of every sequence), ``tokens_per_expert [b, E]``
    counted over whole sequences of ``seq_length`` tokens."""
    b, num_experts = scores.shape[1], scores.shape[2]
    per_expert = scores.sum(dim=0)  # [b, E]
    total = (per_expert * tokens_per_expert.to(per_expert.dtype)).sum()
    return total * (num_experts / (topk * seq_length * seq_length)) / b


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (without its coefficient): ``mean_t logsumexp(logits_t)^2``."""
    return torch.logsumexp(logits.to(score_dtype(logits)), dim=-1).square().mean()


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert may take of ``num_tokens``: ``ceil(capacity_factor * topk * num_tokens / E)``."""
    return int(math.ceil(num_tokens * topk / num_experts * capacity_factor))


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str = "probs",
                   pad_to_capacity: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep at most ``capacity`` tokens per expert; rows are tokens in their order (the position policy
    keeps the earliest, the probs policy the highest weights, ties to the earliest).

    Returns ``(probs, kept [T, E], routing_map [T, E])``: the weights of dropped pairs zeroed, the pairs
    kept, and the pairs to compute, which with ``pad_to_capacity`` adds, for an expert that keeps fewer
    than ``capacity`` tokens, the earliest tokens not routed to it (weight 0) up to ``capacity``."""
    if policy == "position":
        rank = torch.cumsum(routing_map.to(torch.int64), dim=0)  # 1-based position among the expert's tokens
        kept = routing_map & (rank <= capacity)
    elif policy == "probs":
        key = torch.where(routing_map, probs.detach(), torch.full_like(probs, -1.0))
        order = torch.sort(key, dim=0, descending=True, stable=True).indices  # ties: earlier token first
        place = torch.empty_like(order).scatter_(0, order, torch.arange(
            key.shape[0], device=key.device).unsqueeze(1).expand_as(order).contiguous())
        kept = routing_map & (place < capacity)
    else:
        raise ValueError(f"--moe-token-drop-policy must be probs or position, got {policy!r}")
    probs = probs * kept
    if not pad_to_capacity:
        return probs, kept, kept
    free = capacity - kept.sum(dim=0, keepdim=True)  # places left per expert
    filler = ~kept & (torch.cumsum((~kept).to(torch.int64), dim=0) <= free)
    return probs, kept, kept | filler
