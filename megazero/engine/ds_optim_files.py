"""The optimizer files of DeepSpeed's layout, built from megazero's whole fp32 state
(:mod:`megazero.engine.ds_save` writes them): each rank's ``optimizer_state_dict`` at ZeRO 1-2 (its flat
partition of every parameter group, padded to 2 x DP) and at ZeRO-3 (every parameter's own partition,
per sub-group), DeepSpeed's loss scaler for fp16 (and ZeRO-3), and on request its
``param_slice_mappings``.  See ds_save's docstring for the layout."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, List

import torch

from megazero.engine.ds_files import KEYS
from megazero.engine.ds_pickle import Foreign
from megazero.errors import ConfigError

DS_VERSION = "0.19.8"  # the DeepSpeed release whose layout these files follow
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


def param_groups(engine) -> List[Dict]:
    """DeepSpeed's view of the parameter groups: each group's trainable parameter names in order and
    the settings torch's AdamW keeps in its ``param_groups``."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    o = engine.cfg.optimizer
    out = []
    for g in engine.optimizer.param_groups:
        settings = {"lr": float(g["lr"]), "betas": (float(o.adam_beta1), float(o.adam_beta2)),
                    "eps": float(o.adam_eps), "weight_decay": float(g.get("weight_decay", o.weight_decay)),
                    "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                    "differentiable": False, "fused": None, "decoupled_weight_decay": True,
                    "bias_correction": True}
        out.append({"names": [names[id(p)] for p in g["params"] if p.requires_grad], "settings": settings})
    return out


def param_shapes(engine) -> Dict[str, torch.Size]:
    mine = engine.zero.param_shapes()
    return {n: torch.Size(mine.get(p, p.shape)) for n, p in engine.module.named_parameters()}


def step_tensor(engine) -> torch.Tensor:
    return torch.tensor(float(engine.zero.step_count), dtype=torch.float32)


def zero12_files(engine, values, groups, stage: int, world: int) -> List[dict]:
    """Each rank's ``optimizer_state_dict`` at ZeRO 1-2 (see the module docstring)."""
    files = [{"fp32": [], "state": {}, "pads": [], "groups": [], "mappings": []} for _ in range(world)]
    for g, group in enumerate(groups):
        flat = {k: torch.cat([values[k][n] for n in group["names"]]) if group["names"] else torch.zeros(0)
                for k in KEYS}
        n = flat["master"].numel()
        part = -(-n // (2 * world)) * 2
        for r, f in enumerate(files):
            padded = {k: torch.zeros(part) for k in KEYS}
            a, e = min(r * part, n), min((r + 1) * part, n)
            for k in KEYS:
                padded[k][:e - a] = flat[k][a:e]
            pad = part - (e - a)
            f["fp32"].append(padded["master"][:part - pad].clone())
            f["state"][g] = {"step": step_tensor(engine), "exp_avg": padded["exp_avg"],
                             "exp_avg_sq": padded["exp_avg_sq"]}
            f["pads"].append(pad)
            f["groups"].append(dict(group["settings"], params=[g]))
            f["mappings"].append(fragments(group["names"], values["master"], r * part, (r + 1) * part))
    clip = float(engine.cfg.optimizer.clip_grad or 0.0)
    out = [{"dynamic_loss_scale": False, "overflow": False, "clip_grad": clip,
            "base_optimizer_state": {"state": f["state"], "param_groups": f["groups"]},
            "single_partition_of_fp32_groups": f["fp32"], "zero_stage": stage, "group_paddings": f["pads"],
            "param_alignment_paddings": [[0] * len(gr["names"]) for gr in groups],
            "partition_count": [world] * len(groups), "ds_version": DS_VERSION} for f in files]
    if slice_mappings(engine):
        for o, f in zip(out, files):
            o["param_slice_mappings"] = f["mappings"]
    scaler = loss_scaler(engine)
    if scaler is not None:  # fp16: DeepSpeed takes the scaler from the file (else it keeps its own)
        for o in out:
            o["loss_scaler"], o["dynamic_loss_scale"] = scaler, bool(scaler.state["dynamic"])
    return out


def loss_scaler(engine):
    """fp16: megazero's loss scaler as DeepSpeed's (``DynamicLossScaler``: the scale, the hysteresis
    left, the clean steps since the last overflow as ``cur_iter`` after an overflow at -1; a static scale
    as ``LossScaler``); None for fp32 and bf16."""
    if not engine.fp16_enabled():
        return None
    s, module = engine.zero.scaler, "deepspeed.runtime.fp16.loss_scaler"
    if not getattr(s, "dynamic", False):
        return Foreign(module, "LossScaler", state={"cur_scale": float(s.scale), "dynamic": False})
    fp16 = engine.config.raw.get("fp16") or {}
    return Foreign(module, "DynamicLossScaler", state={
        "cur_scale": float(s.scale), "dynamic": True, "cur_iter": int(s.growth_tracker),
        "last_overflow_iter": -1, "scale_factor": float(s.growth_factor),
        "scale_window": int(s.growth_interval), "min_scale": float(s.min_scale),
        "delayed_shift": int(s.hysteresis), "cur_hysteresis": int(s.hysteresis_tracker),
        "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False)),
        "raise_error_at_min_scale": True, "dtype": torch.float16})


def slice_mappings(engine) -> bool:
    """Whether the ds_config asks for ``param_slice_mappings`` (``checkpoint.slice_mappings``)."""
    section = engine.config.raw.get("checkpoint") or {}
    value = section.get("slice_mappings", False) if isinstance(section, dict) else False
    if not isinstance(value, bool):
        raise ConfigError(f"ds_config checkpoint.slice_mappings must be true or false, got {value!r}")
    return value


def fragments(names: List[str], master: Dict[str, torch.Tensor], lo: int, hi: int) -> "OrderedDict":
    """DeepSpeed's ``param_slice_mappings`` of one group on the rank holding flat ``[lo, hi)``: each
    parameter overlapping it -> ``fragment_address(numel, start)`` (start within the partition)."""
    out, offset = OrderedDict(), 0
    for n in names:
        a, e = max(offset, lo), min(offset + master[n].numel(), hi)
        if a < e:
            out[n] = Foreign("deepspeed.utils.tensor_fragment", "fragment_address",
                             state={"numel": e - a, "start": a - lo})
        offset += master[n].numel()
    return out


def sub_groups(names: List[str], shapes, world: int, size: int) -> List[List[str]]:
    """DeepSpeed's ZeRO-3 sub-groups of one parameter group: cut once the partitions reach ``size``."""
    total = sum(-(-math.prod(shapes[n]) // world) for n in names)
    if size >= total:
        return [names]
    out, current, count = [], [], 0
    for n in names:
        current.append(n)
        count += -(-math.prod(shapes[n]) // world)
        if count >= size or n == names[-1]:
            out.append(current)
            current, count = [], 0
    return out


def partition(value: torch.Tensor, world: int, r: int) -> torch.Tensor:
    part = -(-value.numel() // world)
    out = torch.zeros(part, dtype=value.dtype)
    piece = value[r * part:(r + 1) * part]
    out[:piece.numel()] = piece
    return out


def zero3_files(engine, values, groups, world: int) -> List[dict]:
    """Each rank's ``optimizer_state_dict`` at ZeRO-3 (see the module docstring)."""
    shapes = param_shapes(engine)
    zero = engine.config.raw.get("zero_optimization") or {}
    size = int(zero.get("sub_group_size", SUB_GROUP_SIZE) or SUB_GROUP_SIZE)
    out = []
    for r in range(world):
        flats, state, param_groups, i = [], {}, [], 0
        for group in groups:
            ids = []
            for sub in sub_groups(group["names"], shapes, world, size):
                parts = {k: torch.cat([partition(values[k][n], world, r) for n in sub]) for k in KEYS}
                flats.append(parts["master"])
                state[i] = {"step": step_tensor(engine), "exp_avg": parts["exp_avg"],
                            "exp_avg_sq": parts["exp_avg_sq"]}
                ids.append(i)
                i += 1
            param_groups.append(dict(group["settings"], params=ids))
        scaler = loss_scaler(engine) or Foreign("deepspeed.runtime.fp16.loss_scaler", "LossScaler",
                                                state={"cur_scale": 1.0, "dynamic": False})
        out.append({"zero_stage": 3, "loss_scaler": scaler, "overflow": False,
                    "dynamic_loss_scale": bool(scaler.state["dynamic"]), "partition_count": world,
                    "optimizer_state_dict": {"state": state, "param_groups": param_groups},
                    "fp32_flat_groups": flats})
    return out
