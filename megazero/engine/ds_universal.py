"""DeepSpeed's universal checkpoints into megazero's engine (docs/migration.md, "DeepSpeed universal
checkpoints").

DeepSpeed's ``ds_to_universal.py`` turns a ZeRO checkpoint into one directory that names every
parameter whole, whatever the data-parallel size that saved it (0.19.x)::

    DIR/latest_universal                                  the tag, e.g. global_step3_universal
    DIR/<tag>/mp_rank_00_model_states.pt                  copied from the ZeRO 1-2 checkpoint (ZeRO-3:
                                                          zero_pp_rank_<r>_mp_rank_00_model_states.pt)
    DIR/<tag>/zero/<parameter>/fp32.pt                    {"param": the whole fp32 tensor, "cat_dim": ...}
    DIR/<tag>/zero/<parameter>/exp_avg.pt, exp_avg_sq.pt  Adam's moments, the same form
    DIR/<tag>/zero/<parameter>/step.pt                    Adam's step (a scalar)
    DIR/<tag>/zero/optimizer_state.pt                     the param groups, the loss scaler

Converted from ZeRO-3, each state file is the bare flat tensor (its values in the parameter's order),
there is no ``step.pt`` (the step is in ``optimizer_state.pt``, rank 0's whole optimizer state) and no
directory for a tied copy.

Each of this model's trained parameters is read from ``zero/<its name>/``; everything else (the counters,
the learning-rate schedule, persistent buffers, ``client_state``) from the model-states file, as for a
regular DeepSpeed checkpoint (:mod:`megazero.engine.ds_checkpoint`, which calls :func:`read_universal`
and applies the result the same way, at any data-parallel size and ZeRO stage).

A directory holding ``zero/`` is recognised as universal whatever the ds_config says.  The ds_config key
``checkpoint.load_universal`` keeps DeepSpeed's meaning for the tag: when true, ``load_checkpoint(dir)``
without a tag reads it from ``dir/latest_universal`` (:func:`universal_path`).

Every file is read with ``torch.load(weights_only=True)`` and the allow-list of
:func:`megazero.engine.ds_checkpoint.read_file`.  Refused with one line (:class:`CheckpointError`): a
parameter of this model missing from the checkpoint, one of another shape, one the model lacks, a
truncated file, a checkpoint converted from a tensor- or pipeline-parallel DeepSpeed run (its ``zero/``
tensors are merged by Megatron-DeepSpeed's patterns, vocabulary padding stripped and fused
sub-parameters rejoined, which megazero's engine, training one unsliced module, does not map)."""
from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.engine.ds_files import MODEL_STATES, read_file
from megazero.errors import ConfigError

LATEST_UNIVERSAL = "latest_universal"
STATES = {"master": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}


def is_universal(path: str, names: List[str]) -> bool:
    """Whether the tag directory ``path`` (listing ``names``) is a universal checkpoint."""
    return "zero" in names and os.path.isdir(os.path.join(path, "zero"))


def load_universal_key(engine) -> bool:
    """The ds_config's ``checkpoint.load_universal`` (DeepSpeed's default: false)."""
    section = (getattr(engine.config, "raw", None) or {}).get("checkpoint") or {}
    value = section.get("load_universal", False) if isinstance(section, dict) else False
    if not isinstance(value, bool):
        raise ConfigError(f"ds_config checkpoint.load_universal = {value!r} must be true or false")
    return value


def universal_path(engine, load_dir: str, tag) -> Optional[str]:
    """The tag directory ``latest_universal`` names when ``load_universal`` is on and no tag is given
    (as DeepSpeed reads it), else None (the regular ``latest``)."""
    if tag is not None or not load_universal_key(engine):
        return None
    from megazero.engine.engine_state import tag_dir
    where = os.path.join(load_dir, LATEST_UNIVERSAL)
    if not os.path.isfile(where):
        raise CheckpointError(f"{where} does not exist, and ds_config checkpoint.load_universal is true: "
                              "ds_to_universal.py writes it next to the converted tag; give the tag "
                              "(load_checkpoint(dir, tag=...)) or set load_universal false")
    with open(where) as fh:
        return tag_dir(load_dir, fh.read().strip(), where)


def _refuse_sliced(path: str, names: List[str], ms: dict) -> None:
    pipeline = sorted(n for n in names if re.match(r"^layer_\d+", n))
    other_mp = sorted(n for n in names if re.search(r"mp_rank_(?!00_)\d+", n))
    mp = int(ms.get("mp_world_size", 1) or 1)
    if pipeline or other_mp or mp > 1:
        what = (f"pipeline-parallel ({pipeline[0]})" if pipeline else
                f"tensor-parallel ({other_mp[0] if other_mp else f'mp_world_size {mp}'})")
        raise CheckpointError(f"{path} is a universal checkpoint converted from a {what} DeepSpeed run: "
                              "its zero/ tensors are merged by Megatron-DeepSpeed's patterns, which "
                              "megazero's engine (one unsliced module) does not map; megazero reads "
                              "universal checkpoints of data-parallel (ZeRO) runs")


def _tensor(path: str, name: str, shape: tuple) -> torch.Tensor:
    """The tensor of one ``zero/<name>/<state>.pt`` (``{"param": tensor, ...}``, or from ZeRO-3 the bare
    flat tensor), checked against this model's ``shape``."""
    got = read_file(path)
    value = got.get("param") if isinstance(got, dict) else got
    if not torch.is_tensor(value):
        raise CheckpointError(f"{path} holds no tensor for parameter {name}: not a file ds_to_universal.py "
                              "wrote; convert the checkpoint again")
    flat = not isinstance(got, dict) and value.dim() == 1
    if (value.numel() != math.prod(shape)) if flat else (tuple(value.shape) != shape):
        saved = f"{value.numel()} values" if flat else f"shape {list(value.shape)}"
        raise CheckpointError(f"{path}: parameter {name} has {saved} in the universal checkpoint but shape "
                              f"{list(shape)} in this model; build the model that saved it")
    return value


def _model_states(path: str, names: List[str]) -> str:
    for name in (MODEL_STATES, "zero_pp_rank_0_" + MODEL_STATES):
        if name in names:
            return os.path.join(path, name)
    raise CheckpointError(f"{os.path.join(path, MODEL_STATES)} is missing: ds_to_universal.py copies the "
                          "model-states files into the universal checkpoint; copy the whole tag directory")


def _live(engine) -> Dict[str, tuple]:
    """name -> (parameter, its whole shape) of this model, trained and frozen."""
    mine = engine.zero.param_shapes()
    return {n: (p, tuple(mine.get(p, p.shape))) for n, p in engine.module.named_parameters()}


def _check_extra(engine, zero: str, ms: dict, live) -> None:
    from megazero.engine.engine_state import tied_names
    known = set(live) | set(tied_names(engine.module)) | set(ms.get("shared_params") or {})
    known |= set(ms.get("buffer_names") or [])
    extra = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)) and n not in known)
    if extra:
        raise CheckpointError(f"{zero}: the universal checkpoint holds parameter {extra[0]}, which this "
                              "model lacks: it was saved from another model; build the model that saved it")


def _step(zero: str, name: str) -> Optional[float]:
    where = os.path.join(zero, name, "step.pt")
    if not os.path.isfile(where):
        return None
    value = read_file(where)
    return float(value.get("param") if isinstance(value, dict) else value)


def read_universal(engine, path: str, names: List[str], with_optimizer: bool) -> dict:
    """What :func:`megazero.engine.ds_checkpoint.read_checkpoint` gives, read from the universal
    checkpoint in ``path``: ``values`` (state -> name -> whole flat fp32), ``model_states``, ``step``,
    ``lrs``, ``scaler``, ``frozen``, ``buffers``, ``files``."""
    first = _model_states(path, names)
    ms = read_file(first)
    _refuse_sliced(path, names, ms)
    zero = os.path.join(path, "zero")
    live = _live(engine)
    _check_extra(engine, zero, ms, live)
    keys = list(STATES) if with_optimizer else ["master"]
    values = {k: {} for k in keys}
    frozen, steps = {}, set()
    for name, (p, shape) in live.items():
        where = os.path.join(zero, name)
        if not os.path.isdir(where):
            raise CheckpointError(f"{path}: parameter {name} is not in the universal checkpoint (no "
                                  f"zero/{name}/): it was saved from another model; build the model that "
                                  "saved it")
        for k in (keys if p.requires_grad else ["master"]):
            file = os.path.join(where, STATES[k])
            if k != "master" and not os.path.isfile(file):
                raise CheckpointError(f"{file} is missing: parameter {name} has no Adam state in the "
                                      "universal checkpoint; load_optimizer_states=False loads the weights "
                                      "with a fresh optimizer")
            t = _tensor(file, name, shape)
            if p.requires_grad:
                values[k][name] = t.reshape(-1).float()
            else:
                frozen[name] = t.float().view(shape)
        if with_optimizer and p.requires_grad:
            step = _step(zero, name)
            if step is not None:
                steps.add(step)
    if len(steps) > 1:
        raise CheckpointError(f"{zero}: the parameters were stepped {sorted(steps)} times; megazero's Adam "
                              "keeps one step count")
    optim = read_file(os.path.join(zero, "optimizer_state.pt"))
    if with_optimizer and not steps:  # converted from ZeRO-3: rank 0's optimizer state holds the step
        inner = (optim.get("optimizer_state_dict") or {}).get("state") or {}
        steps = {float(v["step"]) for v in inner.values() if isinstance(v, dict) and "step" in v}
    if len(steps) > 1:
        raise CheckpointError(f"{zero}: the parameters were stepped {sorted(steps)} times; megazero's Adam "
                              "keeps one step count")
    if with_optimizer and not steps:
        raise CheckpointError(f"{zero}: no step.pt holds Adam's step count; load_optimizer_states=False "
                              "loads the weights with a fresh optimizer")
    module = ms.get("module") or {}
    return {"model_states": ms, "files": first, "values": values, "frozen": frozen,
            "step": int(steps.pop()) if steps else None,
            "lrs": [float(g["lr"]) for g in optim.get("param_groups", []) if "lr" in g],
            "scaler": getattr(optim.get("loss_scaler"), "__dict__", {}) or {},
            "buffers": {n: module[n] for n in ms.get("buffer_names") or [] if n in module}}
