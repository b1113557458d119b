"""The optimizer state in Megatron-LM's legacy files (``mp_rank_*/model_optim_rng.pt``'s ``optimizer``:
torch's ``optimizer.state_dict()``, its state by index), named by the model's keys.

The index is the parameter's place in megatron-core's parameter groups: weights with weight decay, then
biases and 1-D parameters without (each in the model's parameter order; a group's ``wd_mult`` says
which, ``is_decoupled_lr`` groups hold the embedding and output layer), and every state's shape is
checked against its weight.  Mixed precision wraps the state dict as ``{"optimizer": ...,
"grad_scaler": ..., "fp32_from_fp16_params": [[...]]}`` (the fp32 main weights, by group).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megazero.checkpoint.errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state names in Megatron-core's files
MAIN = "fp32_param"  # the mixed-precision optimizer's fp32 main weights
FRESH = "; pass --no-load-optim to start with a fresh optimizer"


class LegacyOptimizer:
    """The per-rank optimizer states of a legacy checkpoint, by the model's keys."""

    def __init__(self, ck):
        self.ck = ck
        self._by_key: Dict[Tuple[int, int], Dict[str, dict]] = {}

    def fetcher(self, kind: str):
        def fetch(t: int, p: int, key: str) -> torch.Tensor:
            state = self.rank_state(t, p).get(key)
            if state is None or kind not in state:
                raise CheckpointError(f"{self.ck._files[(t, p)]}: the optimizer holds no {kind} for {key}"
                                      + FRESH)
            return state[kind].float()
        return fetch

    def rank_state(self, t: int, p: int) -> Dict[str, dict]:
        """The states of rank file ``(t, p)``; those of one pipeline stage's files are kept at a time,
        as the weights' files are (a conversion goes stage by stage)."""
        if (t, p) not in self._by_key:
            if len(self._by_key) >= max(2, getattr(self.ck, "tp", 1)):
                self._by_key.pop(next(iter(self._by_key)))
            self._by_key[(t, p)] = _legacy_by_key(self.ck._rank(t, p), self.ck._files[(t, p)])
        return self._by_key[(t, p)]


def unwrap(opt: dict) -> Tuple[dict, Optional[list]]:
    """torch's optimizer state dict, and the fp32 main weights by group (mixed precision only)."""
    if "state" in opt and "param_groups" in opt:
        return opt, None
    inner = opt.get("optimizer")
    if isinstance(inner, dict) and "state" in inner:
        return inner, opt.get("fp32_from_fp16_params")
    raise CheckpointError("the optimizer entry is neither torch's state dict nor Megatron's mixed-precision "
                          "wrapper of it")


def _no_decay(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".bias") or t.dim() == 1


def _legacy_by_key(rank: dict, fpath: str) -> Dict[str, dict]:
    """``{model key: {exp_avg, exp_avg_sq[, fp32_param]}}`` of one rank file's optimizer."""
    if not isinstance(rank.get("optimizer"), dict):
        raise CheckpointError(f"{fpath}: holds no optimizer state (the checkpoint's other ranks do)" + FRESH)
    try:
        opt, mains = unwrap(rank["optimizer"])
    except CheckpointError as err:
        raise CheckpointError(f"{fpath}: {err}{FRESH}") from None
    model = [(k, v) for k, v in rank["model"].items()
             if torch.is_tensor(v) and not k.endswith("_extra_state")]
    out: Dict[str, dict] = {}
    for g, group in enumerate(opt["param_groups"]):
        if "wd_mult" not in group:
            raise CheckpointError(f"{fpath}: the optimizer's parameter groups carry no wd_mult (an older "
                                  "Megatron-LM); their parameters cannot be named" + FRESH)
        members = [(k, v) for k, v in model if _no_decay(k, v) == (float(group["wd_mult"]) == 0.0)
                   and (("word_embeddings" in k or "output_layer" in k) or not group.get("is_decoupled_lr"))]
        if len(members) != len(group["params"]):
            raise CheckpointError(f"{fpath}: optimizer parameter group {g} has {len(group['params'])} "
                                  f"parameters, the model {len(members)} of its kind" + FRESH)
        for j, ((key, weight), index) in enumerate(zip(members, group["params"])):
            state = dict(opt["state"].get(index, {}))
            if mains is not None:
                state[MAIN] = mains[g][j]
            for kind, value in state.items():
                if torch.is_tensor(value) and value.dim() and tuple(value.shape) != tuple(weight.shape):
                    raise CheckpointError(f"{fpath}: the optimizer's {kind} of {key} is "
                                          f"{tuple(value.shape)}, "
                                          f"the weight {tuple(weight.shape)}" + FRESH)
            out[key] = state
    return out
