"""The mixture-of-experts settings as the model and the checks read them: which layers are MoE layers,
and the rules every combination of the MoE flags must follow (Megatron-LM's, plus what megazero does
not implement), checked at start-up by :func:`megazero.config.validate`, each error naming the flags.

Pure Python (no torch), so validating a configuration stays cheap."""
from __future__ import annotations

import re
from typing import List, Optional

from megazero.moe.list_expression import ListExpressionError, parse_list_expression

DISPATCHERS = ("allgather", "alltoall")
BALANCING = ("aux_loss", "seq_aux_loss", "none")


def is_moe(moe) -> bool:
    """Whether the settings ask for a mixture of experts (``--num-experts`` given and above 0)."""
    return bool(moe.num_experts)


def moe_layer_pattern(freq, num_layers: int) -> List[bool]:
    """``--moe-layer-freq`` as one flag per layer (True: an MoE layer), Megatron-LM's two forms: an
    integer N (layers 0, N, 2N, ... are MoE) or a list expression of 0s and 1s, one per layer, such as
    ``"([0]*1+[1]*1)*2"``, read by :mod:`megazero.moe.list_expression` (never ``eval``: digits,
    brackets, parentheses, commas, ``+`` and ``*`` only, every size bounded).  ValueError naming the
    flag otherwise."""
    text = str(freq).strip()
    if re.fullmatch(r"\d+", text):
        if len(text) > 18:
            raise ValueError(f"--moe-layer-freq {text[:20]}...: an integer frequency of {len(text)} digits; "
                             "give at most --num-layers")
        n = int(text)
        if n < 1:
            raise ValueError(f"--moe-layer-freq {text}: an integer frequency must be at least 1")
        return [i % n == 0 for i in range(num_layers)]
    try:
        pattern = parse_list_expression(text)
    except ListExpressionError as err:
        raise ValueError(f"--moe-layer-freq {text[:80]!r}: {err}; give an integer N or a list expression "
                         "of 0s and 1s such as '([0]*1+[1]*1)*2'") from None
    if not isinstance(pattern, list) or any(v not in (0, 1) or isinstance(v, bool) for v in pattern):
        raise ValueError(f"--moe-layer-freq {text[:80]!r} is not a list of 0s and 1s (e.g. "
                         "'([0]*1+[1]*1)*2')")
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {text[:80]!r} gives {len(pattern)} layers but --num-layers is "
                         f"{num_layers}; give one 0 or 1 per layer")
    return [bool(v) for v in pattern]


def moe_layers(cfg) -> List[int]:
    """Global indices of the MoE layers (none for a dense model)."""
    if not is_moe(cfg.moe):
        return []
    hybrid = getattr(cfg.model, "hybrid_layer_pattern", None)
    if hybrid:  # a hybrid stack: its E layers (megazero.config.hybrid)
        return [i for i, kind in enumerate(hybrid) if kind == "E"]
    return [i for i, on in enumerate(moe_layer_pattern(cfg.moe.moe_layer_freq, cfg.model.num_layers)) if on]


def mtp_moe_layers(cfg) -> List[int]:
    """Global indices (``--num-layers + k``) of the multi-token prediction layers that are MoE layers: all
    of them when the last decoder layer is one (Megatron-core builds them with the last layer's spec)."""
    n, layers = cfg.model.mtp_num_layers, moe_layers(cfg)
    if not n or not layers or layers[-1] != cfg.model.num_layers - 1:
        return []
    return list(range(cfg.model.num_layers, cfg.model.num_layers + n))


def check_moe(cfg) -> None:
    """Raise ValueError naming the flags unless the MoE settings are a valid combination (a resolved
    config: sizes derived)."""
    moe, par, mod = cfg.moe, cfg.parallel, cfg.model
    ep, etp = moe.expert_model_parallel_size, moe.expert_tensor_parallel_size
    if not is_moe(moe):
        given = [flag for flag, on in (("--expert-model-parallel-size", ep != 1),
                                       ("--moe-shared-expert-intermediate-size",
                                        moe.moe_shared_expert_intermediate_size is not None),
                                       ("--moe-expert-capacity-factor",
                                        moe.moe_expert_capacity_factor is not None),
                                       ("--moe-router-num-groups", moe.moe_router_num_groups is not None),
                                       ("--moe-apply-probs-on-input", moe.moe_apply_probs_on_input))
                 if on]
        if given:
            raise ValueError(f"{given[0]} needs --num-experts (a mixture-of-experts model)")
        return
    _check_sizes(moe, mod, par, ep, etp)
    _check_router(moe)
    _check_dispatch(moe, mod, par, etp)
    moe_layer_pattern(moe.moe_layer_freq, mod.num_layers)


def _check_sizes(moe, mod, par, ep: int, etp: Optional[int]) -> None:
    e, k = moe.num_experts, moe.moe_router_topk
    if not isinstance(e, int) or e < 1:
        raise ValueError(f"--num-experts must be a positive integer, got {e!r}")
    if not isinstance(k, int) or k < 1 or k > e:
        raise ValueError(f"--moe-router-topk {k} must be between 1 and --num-experts {e}")
    if ep < 1 or e % ep:
        raise ValueError(f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}; each "
                         "expert-parallel rank holds the same number of experts")
    for flag, v in (("--moe-ffn-hidden-size", moe.moe_ffn_hidden_size),
                    ("--moe-shared-expert-intermediate-size", moe.moe_shared_expert_intermediate_size)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if moe.moe_ffn_hidden_size % etp:
        raise ValueError(f"--moe-ffn-hidden-size {moe.moe_ffn_hidden_size} is not divisible by "
                         f"--expert-tensor-parallel-size {etp}")
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None and shared % par.tensor_model_parallel_size:
        raise ValueError(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                         f"--tensor-model-parallel-size {par.tensor_model_parallel_size}")
    if mod.add_bias_linear and etp > 1:
        raise ValueError(f"MoE layers with biases (no --disable-bias-linear) need "
                         f"--expert-tensor-parallel-size 1, got {etp} (Megatron-LM's rule)")


def _check_router(moe) -> None:
    lb = moe.moe_router_load_balancing_type
    if lb not in BALANCING:
        raise ValueError(f"--moe-router-load-balancing-type {lb} is not implemented; use aux_loss, "
                         "seq_aux_loss or none (with --moe-router-enable-expert-bias for aux-loss-free "
                         "balancing)")
    if moe.moe_router_enable_expert_bias and moe.moe_router_score_function != "sigmoid":
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                         "(Megatron-LM's rule)")
    for flag, v in (("--moe-aux-loss-coeff", moe.moe_aux_loss_coeff),
                    ("--moe-z-loss-coeff", moe.moe_z_loss_coeff),
                    ("--moe-router-bias-update-rate", moe.moe_router_bias_update_rate)):
        if v is not None and v < 0:
            raise ValueError(f"{flag} must be >= 0, got {v}")
    if moe.moe_apply_probs_on_input and moe.moe_router_topk != 1:
        raise ValueError(f"--moe-apply-probs-on-input needs --moe-router-topk 1, got {moe.moe_router_topk} "
                         "(Megatron-LM's rule: the weight scales the one expert's input)")
    scale = moe.moe_router_topk_scaling_factor
    if scale is not None and scale <= 0:
        raise ValueError(f"--moe-router-topk-scaling-factor must be > 0, got {scale}")
    _check_groups(moe)


def _check_groups(moe) -> None:
    """Group-limited routing: groups divide the experts, the chosen groups hold the top-k."""
    groups, gk, per = moe.moe_router_num_groups, moe.moe_router_group_topk, moe.moe_router_group_score_topk
    if groups is None and gk is None:
        if per is not None:
            raise ValueError("--moe-router-group-score-topk needs --moe-router-num-groups and "
                             "--moe-router-group-topk")
        return
    if groups is None or gk is None:
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited "
                         "routing); give both or neither")
    e, k = moe.num_experts, moe.moe_router_topk
    if groups < 1 or e % groups:
        raise ValueError(f"--moe-router-num-groups {groups} must divide --num-experts {e}")
    if not 1 <= gk <= groups:
        raise ValueError(f"--moe-router-group-topk {gk} must be between 1 and --moe-router-num-groups "
                         f"{groups}")
    if gk * (e // groups) < k:
        raise ValueError(f"--moe-router-group-topk {gk} groups of {e // groups} experts hold fewer than "
                         f"--moe-router-topk {k}; choose more groups")
    size = e // groups
    per = per if per is not None else k // gk
    if not 1 <= per <= size:
        raise ValueError(f"a group's score sums its best --moe-router-topk / --moe-router-group-topk = {per} "
                         f"experts, which must be between 1 and the {size} experts of a group; set "
                         "--moe-router-group-score-topk")


def _check_dispatch(moe, mod, par, etp: int) -> None:
    if moe.moe_token_dispatcher_type not in DISPATCHERS:
        raise ValueError(f"--moe-token-dispatcher-type {moe.moe_token_dispatcher_type} is not implemented; "
                         "use alltoall or allgather")
    cf = moe.moe_expert_capacity_factor
    if cf is not None and cf <= 0:
        raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {cf} (leave it out for dropless)")
    if moe.moe_pad_expert_input_to_capacity and cf is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    tp = par.tensor_model_parallel_size
    if tp > 1 and not par.sequence_parallel:
        raise ValueError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                         "(Megatron-LM's rule for MoE layers under tensor parallelism)")
