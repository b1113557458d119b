"""DeepSpeed's own checkpoints into megazero's engine: ``engine.load_checkpoint(DIR, tag=None)`` on a
directory DeepSpeed wrote (docs/migration.md).

DeepSpeed's layout (0.19.x; ``DIR/latest`` names the tag, ``global_step<N>`` by default)::

    DIR/<tag>/mp_rank_00_model_states.pt                ZeRO 1-2: the module's weights, the counters,
                                                         the scheduler, param_shapes, client_state
    DIR/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt     ZeRO-3: the same, one per rank
    DIR/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt     every rank's fp32 partition and Adam state
    DIR/<tag>/bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt  the same under bf16 at ZeRO-1

From the optimizer files each parameter's fp32 master weight, ``exp_avg`` and ``exp_avg_sq`` are put
back together whole (ZeRO 1-2: the ranks' flat partitions of each group joined, parameters in
``param_shapes`` order; ZeRO-3: every parameter split over the ranks on its own, padded to a multiple
of the rank count), then copied into this engine's own slices at its data-parallel size and ZeRO
stage.  Restored too: Adam's step, the groups' learning rates, the loss scale of a dynamic fp16 scaler,
the learning-rate schedule (``last_batch_iteration``), the step and sample counters, persistent
buffers and frozen parameters (from the module's weights).  ``client_state`` is the keys of the
model-states file that are not DeepSpeed's own (:data:`DS_KEYS`): what the script saved (DeepSpeed's
own load returns a few of its bookkeeping keys besides).

Nothing in the files runs code: each is read with ``torch.load(weights_only=True)``.  DeepSpeed pickles
a few objects of its own (its loss scaler, the ZeRO stage enum, fragment addresses); those names, and
only those, are read into inert records (:data:`STORED`), never into DeepSpeed's classes.  Any other
global is refused with one line naming it.  A missing or truncated file, a checkpoint of another model
shape, or a layout megazero does not map (tensor-parallel ``mp_rank_01``, DeepSpeed's pipeline-engine
``layer_*-model_states.pt``, the optimizer state of a run without ZeRO) raises
:class:`CheckpointError` (exit status 2).  A run without ZeRO gives its weights from the module's
``state_dict`` (``load_optimizer_states=False``).  Every rank reads every optimizer file (memory-mapped),
so a rank briefly holds the whole fp32 state once.  A universal checkpoint (``zero/<parameter>/``, what
DeepSpeed's ``ds_to_universal.py`` writes) is read by :mod:`megazero.engine.ds_universal` and applied here.
"""
from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.engine.ds_files import (  # noqa: F401 - the file names and reader, public here too
    DS_KEYS, KEYS, MODEL_STATES, OPTIM_NAME, STORED, StoredRecord, is_deepspeed_checkpoint, read_file,
    stored_enum)


def _refuse_layout(path: str, names: List[str]) -> None:
    pipeline = sorted(n for n in names if re.match(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+", n))
    if pipeline:
        raise CheckpointError(f"{path} is a DeepSpeed pipeline-engine (PipelineModule) checkpoint "
                              f"({pipeline[0]}, ...); megazero's engine trains one module and cannot map its "
                              "layers: convert it with DeepSpeed's zero_to_fp32.py and load the weights")
    other_mp = sorted(n for n in names if re.search(r"mp_rank_(?!00_)\d+", n))
    if other_mp:
        raise CheckpointError(f"{path} was saved with DeepSpeed tensor parallelism ({other_mp[0]}); "
                              "megazero's engine loads mp_rank_00 checkpoints (no model parallelism) only")


def _param_shapes(model_states: dict, path: str) -> Dict[str, Tuple[int, ...]]:
    shapes = model_states.get("param_shapes")
    if isinstance(shapes, dict):
        shapes = [shapes]
    if not isinstance(shapes, list):
        raise CheckpointError(f"{path}: no param_shapes, so its optimizer files cannot be mapped to "
                              "parameters: not a checkpoint DeepSpeed's ZeRO wrote")
    return [{name: tuple(int(d) for d in shape) for name, shape in group.items()} for group in shapes]


def _optim_files(path: str, names: List[str], world: int) -> List[str]:
    found = {int(m.group(2)): n for n, m in ((n, OPTIM_NAME.match(n)) for n in names) if m}
    if not found:
        raise CheckpointError(f"{path} holds no zero_pp_rank_*_mp_rank_00_optim_states.pt: every rank of a "
                              "ZeRO-3 checkpoint writes one; copy the whole tag directory")
    prefix = next(iter(found.values())).split("zero_pp_rank_")[0]
    for r in range(world):
        if r not in found:
            name = f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            raise CheckpointError(f"{os.path.join(path, name)} is missing: the checkpoint was saved by "
                                  f"{world} data-parallel ranks (dp_world_size) and each wrote its own "
                                  "file; copy the whole tag directory")
    return [os.path.join(path, found[r]) for r in range(world)]


def _cat(parts: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1).float() for p in parts])


def _zero12(shards: List[dict], groups, keys, path: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """ZeRO 1-2: per group, the ranks' flat partitions joined; parameters in order, with DeepSpeed's
    per-parameter alignment padding."""
    out = {k: {} for k in keys}
    for g, shapes in enumerate(groups):
        flats = {"master": _cat([s["single_partition_of_fp32_groups"][g] for s in shards])}
        for k in keys[1:]:
            flats[k] = _cat([_adam_state(s.get("base_optimizer_state"), g, path)[k] for s in shards])
        pads = shards[0].get("param_alignment_paddings")
        pads = pads[g] if pads is not None else [0] * len(shapes)
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            n = math.prod(shape)
            if offset + n > flats["master"].numel():
                raise CheckpointError(f"{path}: group {g} holds {flats['master'].numel()} values, fewer than "
                                      "its param_shapes name: the optimizer files do not belong together")
            for k in keys:
                out[k][name] = flats[k][offset:offset + n]
            offset += n + int(pad)
    return out


def _adam_state(base, i: int, path: str) -> dict:
    """Sub-group ``i``'s Adam state in a torch optimizer ``state_dict`` ``base``."""
    state = base.get("state") if isinstance(base, dict) else None
    if not isinstance(state, dict) or "exp_avg" not in state.get(i, {}) or "exp_avg_sq" not in state[i]:
        raise CheckpointError(f"{path}: the optimizer state is not Adam's (exp_avg, exp_avg_sq per group); "
                              "load_optimizer_states=False loads the weights with a fresh optimizer")
    return state[i]


def _zero3(shards: List[dict], groups, keys, path: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """ZeRO-3: each parameter split over the W ranks on its own (ceil(numel / W) values each, the
    last padded), the ranks' sub-groups concatenated in parameter order."""
    world, out = len(shards), {k: {} for k in keys}
    flats = {k: [] for k in keys}
    for s in shards:
        flats["master"].append(_cat(s["fp32_flat_groups"]))
        subgroups = range(len(s["fp32_flat_groups"]))
        for k in keys[1:]:
            flats[k].append(_cat([_adam_state(s.get("optimizer_state_dict"), i, path)[k] for i in subgroups]))
    offset = 0
    for shapes in groups:
        for name, shape in shapes.items():
            n = math.prod(shape)
            part = -(-n // world)
            if offset + part > flats["master"][0].numel():
                raise CheckpointError(f"{path}: the ranks' partitions hold fewer values than param_shapes "
                                      "names: the optimizer files do not belong together")
            for k in keys:
                out[k][name] = torch.cat([f[offset:offset + part] for f in flats[k]])[:n]
            offset += part
    return out


def _module_weights(engine, ms: dict, path: str, with_optimizer: bool) -> Dict[str, Dict[str, torch.Tensor]]:
    """A checkpoint without ZeRO's files: the weights from the module's ``state_dict`` (the optimizer
    state, inside the model-states file in torch's per-parameter form, is not mapped)."""
    if with_optimizer:
        raise CheckpointError(f"{path} holds no zero_pp_rank_*_optim_states.pt: a DeepSpeed checkpoint "
                              "without ZeRO, whose optimizer state megazero does not map; "
                              "load_optimizer_states=False (or load_module_only=True) loads the weights")
    from megazero.engine.engine_state import tied_names
    module = ms.get("module") or {}
    skip = set(ms.get("buffer_names") or []) | set(ms.get("shared_params") or {})
    skip |= set(tied_names(engine.module))  # DeepSpeed names tied copies only under ZeRO
    shapes = {n: tuple(t.shape) for n, t in module.items() if n not in skip}
    _check_shapes(engine, shapes, {}, path)
    return {"master": {n: module[n].reshape(-1).float() for n in shapes}}


def _optimizer_meta(shards: List[dict], stage: int, path: str,
                    with_optimizer: bool) -> Tuple[Optional[int], List[float], dict]:
    """(Adam's step, the groups' learning rates, the loss scaler's attributes) of rank 0's file; the
    step is the state's (torch's Adam, DeepSpeed's CPU Adam and FusedAdam today) or the param groups'
    (FusedAdam's older checkpoints)."""
    osd = shards[0]
    inner = osd.get("optimizer_state_dict", {}) if stage == 3 else osd.get("base_optimizer_state", {})
    steps = {float(v["step"]) for v in inner.get("state", {}).values() if "step" in v}
    steps = steps or {float(g["step"]) for g in inner.get("param_groups", []) if "step" in g}
    if with_optimizer and not steps:
        raise CheckpointError(f"{path}: the optimizer state holds no Adam step count; "
                              "load_optimizer_states=False loads the weights with a fresh optimizer")
    if len(steps) > 1:
        raise CheckpointError(f"{path}: the parameter groups were stepped {sorted(steps)} times; megazero's "
                              "Adam keeps one step count")
    lrs = [float(g["lr"]) for g in inner.get("param_groups", [])]
    scaler = getattr(osd.get("loss_scaler"), "__dict__", {}) or {}
    return (int(steps.pop()) if steps else None), lrs, scaler


def _check_shapes(engine, shapes: Dict[str, Tuple[int, ...]], frozen: Dict[str, Tuple[int, ...]],
                  path: str) -> None:
    mine = engine.zero.param_shapes()
    live = {}
    for name, p in engine.module.named_parameters():
        live[name] = tuple(mine.get(p, p.shape))
    saved = {**shapes, **frozen}
    for name, shape in live.items():
        if name not in saved:
            raise CheckpointError(f"{path}: parameter {name} is not in the DeepSpeed checkpoint: it was "
                                  "saved from another model; build the model that saved it")
        if tuple(saved[name]) != shape:
            raise CheckpointError(f"{path}: parameter {name} has shape {list(saved[name])} in the DeepSpeed "
                                  f"checkpoint but {list(shape)} in this model; build the model that saved "
                                  "it")
    extra = sorted(set(saved) - set(live))
    if extra:
        raise CheckpointError(f"{path}: the DeepSpeed checkpoint holds parameter {extra[0]}, which this "
                              "model lacks: it was saved from another model; build the model that saved it")


def read_checkpoint(engine, path: str, with_optimizer: bool) -> dict:
    """Everything the engine takes from the DeepSpeed checkpoint in ``path``, read and checked, nothing
    applied: ``values`` (key -> name -> whole flat fp32), ``model_states``, ``step``, ``lrs``, ``scaler``,
    ``frozen`` (name -> tensor), ``buffers``."""
    names = sorted(os.listdir(path))
    from megazero.engine.ds_universal import is_universal, read_universal
    if is_universal(path, names):  # ds_to_universal.py's zero/<parameter>/ layout
        return read_universal(engine, path, names, with_optimizer)
    _refuse_layout(path, names)
    zero3 = any(re.match(r"^zero_pp_rank_\d+_mp_rank_00_model_states\.pt$", n) for n in names)
    first = os.path.join(path, ("zero_pp_rank_0_" if zero3 else "") + MODEL_STATES)
    ms = read_file(first)
    world = int(ms.get("dp_world_size", 1))
    module = ms.get("module") or {}
    got = {"model_states": ms, "step": None, "lrs": [], "scaler": {}, "frozen": {}, "files": first,
           "buffers": {n: module[n] for n in ms.get("buffer_names") or [] if n in module}}
    if not zero3 and not any(OPTIM_NAME.match(n) for n in names):
        values = _module_weights(engine, ms, first, with_optimizer)
        frozen = {n: module[n].float() for n, p in engine.module.named_parameters() if not p.requires_grad}
        return dict(got, values=values, frozen=frozen)
    groups = _param_shapes(ms, first)
    shapes = {n: s for g in groups for n, s in g.items()}
    frozen_shapes = {n: tuple(s) for n, s in (ms.get("frozen_param_shapes") or {}).items()}
    _check_shapes(engine, shapes, frozen_shapes, first)
    shards = [read_file(f)["optimizer_state_dict"] for f in _optim_files(path, names, world)]
    keys = list(KEYS) if with_optimizer else ["master"]
    got["values"] = (_zero3 if zero3 else _zero12)(shards, groups, keys, path)
    got["step"], got["lrs"], got["scaler"] = _optimizer_meta(shards, 3 if zero3 else 2, path, with_optimizer)
    for name, shape in frozen_shapes.items():
        if zero3:
            files = [os.path.join(path, f"zero_pp_rank_{r}_{MODEL_STATES}") for r in range(world)]
            parts = [read_file(f)["frozen_param_fragments"][name] for f in files]
            got["frozen"][name] = _cat(parts)[:math.prod(shape)].view(shape)
        else:
            got["frozen"][name] = module[name].float().view(shape)
    return got


def scaler_state(scaler: dict) -> Optional[dict]:
    """DeepSpeed's dynamic loss scaler as megazero's scaler state (None for a static one): the scale,
    the hysteresis left, and the clean steps since the last overflow within its window."""
    if not scaler.get("dynamic"):
        return None
    window = int(scaler.get("scale_window", 1000)) or 1
    clean = int(scaler.get("cur_iter", 0)) - int(scaler.get("last_overflow_iter", -1)) - 1
    return {"scale": float(scaler["cur_scale"]), "growth_tracker": clean % window,
            "hysteresis_tracker": int(scaler.get("cur_hysteresis", 1)), "dynamic": True}


def _fill(engine, values: Dict[str, Dict[str, torch.Tensor]]) -> None:
    """Copy the whole per-parameter values into this rank's slices of the engine's optimizer, bucket
    by bucket, and republish the parameters (collective over data parallelism)."""
    opt, keys = engine.zero, list(values)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    update = opt.update
    for b in opt.buckets:
        lo = opt.storage.updated_range(b)[0]
        starts = {id(p): s for p, s in zip(b.params, b.starts)}
        opt.storage.begin_update(b)
        for j, (a, e) in enumerate(update.pieces(b)):
            tensors = update.piece_tensors(b, j, keys, read=False)
            with torch.no_grad():
                for k in keys:
                    flat = tensors[k].view(-1)
                    flat.zero_()
                    for p, pa, pe in b.segments(lo + a, lo + e):
                        s = starts[id(p)]
                        src = values[k][names[id(p)]][pa - s:pe - s]
                        flat[pa - lo - a:pe - lo - a].copy_(src.to(flat.device, flat.dtype))
                update.commit_piece(b, j, tensors)
        opt.publish_params(b)
        opt.storage.end_update(b)


def load_deepspeed(engine, path: str, load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True, load_module_only: bool = False
                   ) -> Tuple[str, Optional[dict]]:
    """``engine.load_checkpoint`` of the DeepSpeed tag directory ``path`` (collective): returns
    ``(path, client_state)``.  Every rank reads and checks first; one rank's error is every rank's."""
    from megazero.checkpoint.comm import agree
    from megazero.engine.engine_state import check_batch, persistent_buffers
    from megazero.engine.engine_state import restore_rates
    with_optim = load_optimizer_states and not load_module_only
    error, got = None, None
    try:
        got = read_checkpoint(engine, path, with_optim)
        if not load_module_only:
            ms = got["model_states"]
            check_batch(engine, {"train_batch_size": (ms.get("ds_config") or {}).get("train_batch_size"),
                                 "global_steps": ms.get("global_steps")}, got["files"])
    except Exception as err:  # noqa: BLE001 - every rank stops before the collectives below
        error = err
    agree(error, engine.mesh, "")
    ms = got["model_states"]
    if not with_optim:
        engine.zero.update.zero_state()
        engine.zero.step_count = 0
    _fill(engine, got["values"])
    live = persistent_buffers(engine.module)
    params = dict(engine.module.named_parameters())
    with torch.no_grad():
        for name, value in got["frozen"].items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))
        for name, value in got["buffers"].items():
            if name in live:
                live[name].copy_(value.to(live[name].device, live[name].dtype))
    if with_optim:
        if got["step"] is not None:
            engine.zero.step_count = got["step"]
        scaler = scaler_state(got["scaler"])
        if scaler is not None:
            engine.zero.scaler.load_state_dict(scaler)
    if not load_module_only:
        engine.global_steps = int(ms.get("global_steps", 0))
        engine.global_samples = int(ms.get("global_samples", 0))
        engine.micro_steps = engine.global_steps * engine.config.gradient_accumulation_steps
        engine.skipped_steps = int(ms.get("skipped_steps", 0))
        sched = ms.get("lr_scheduler")
        if load_lr_scheduler_states and isinstance(sched, dict) and sched and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(sched)
        if with_optim or load_lr_scheduler_states:
            restore_rates(engine, got["lrs"] or None)
    engine.zero.zero_grad()
    client = {k: v for k, v in ms.items() if k not in DS_KEYS}
    return path, client
