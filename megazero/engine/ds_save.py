"""The engine's checkpoint in DeepSpeed's own layout, for DeepSpeed to continue the run
(``engine.save_checkpoint(dir, format="deepspeed")``, or ``"checkpoint": {"format": "deepspeed"}`` in the
ds_config; docs/migration.md, "megazero -> DeepSpeed").

What DeepSpeed 0.19's ``engine.load_checkpoint`` and its ``zero_to_fp32`` read, for ZeRO 1-2 (DIR/<tag>/)::

    mp_rank_00_model_states.pt        rank 0: the module's state_dict, buffer_names, param_shapes (one
                                      ordered name -> torch.Size per parameter group), shared_params (tied
                                      names), frozen_param_shapes/fragments, lr_scheduler, the step and
                                      sample counters, dp_world_size, ds_config, ds_version, client_state
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r: {"optimizer_state_dict": ...}

ZeRO 1-2: each group's trainable parameters flattened in order, zero-padded to a multiple of 2 x DP and
cut into DP equal partitions; rank r's file holds its fp32 partition (``single_partition_of_fp32_groups``,
without the padding), torch's Adam ``state_dict`` over the partitions (``base_optimizer_state``:
``step``, ``exp_avg``, ``exp_avg_sq``, the groups' settings), ``group_paddings``,
``param_alignment_paddings``, ``partition_count``, ``zero_stage``, ``clip_grad``, ``ds_version``.  ZeRO-3:
one model-states file per rank (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``, the parameters as
empty tensors, as DeepSpeed saves them) and per rank every parameter's own partition (ceil(numel / DP)
values, the last padded) concatenated per sub-group (``fp32_flat_groups``; DeepSpeed's
``sub_group_size`` rule), with Adam's state in the same layout.

Plain types only (tensors, torch.Size, dict, list, numbers, strings), with one exception: DeepSpeed's
loader takes its loss scaler object from the optimizer file and calls its methods (ZeRO-3 always, ZeRO
1-2 when the file has one), so the ZeRO-3 files, and the fp16 files, name
``deepspeed.runtime.fp16.loss_scaler.LossScaler`` ({cur_scale: 1.0, dynamic: false}: no scaling, as
fp32 and bf16 run; fp16 with a static scale: that scale) or ``DynamicLossScaler`` (fp16: megazero's
scale, hysteresis and clean steps), written by :mod:`megazero.engine.ds_pickle`.  fp32/bf16 ZeRO 1-2
files leave the loss scaler out (DeepSpeed keeps the one its config builds).  Not written: bf16 at
ZeRO-1 and runs without ZeRO (DeepSpeed's BF16_Optimizer and per-parameter formats), SGD.
``param_slice_mappings`` (DeepSpeed's ``fragment_address`` objects, which only its ``ds_to_universal.py``
reads, at ZeRO 1-2) only with ``"checkpoint": {"slice_mappings": true}``: the files then name that class
too.  Every rank builds the whole fp32 state once (an all-gather per bucket).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict

import torch
import torch.distributed as dist

from megazero.engine.ds_optim_files import (DS_VERSION, KEYS, param_groups, param_shapes, partition,
                                            slice_mappings, zero3_files, zero12_files)
from megazero.errors import ConfigError

FORMATS = ("megazero", "deepspeed")


def checkpoint_format(engine, given) -> str:
    """The format to save in: ``given``, else the ds_config's ``checkpoint.format``, else megazero's."""
    if given is None:
        section = engine.config.raw.get("checkpoint") or {}
        given = section.get("format", "megazero") if isinstance(section, dict) else "megazero"
    value = str(given).lower() if isinstance(given, str) else given
    if value not in FORMATS:
        raise ConfigError(f"save_checkpoint format={given!r} is not one of {', '.join(FORMATS)}: 'megazero' "
                          "(the default) or 'deepspeed' (DeepSpeed's own layout, docs/migration.md)")
    return value


def _check_supported(engine, client_state: dict) -> int:
    from megazero.engine.engine_state import not_plain
    from megazero.engine.ds_files import DS_KEYS
    stage = engine.zero_optimization_stage()
    slice_mappings(engine)  # a valid value, before any collective
    what = None
    if stage == 0:
        what = "a run without ZeRO (DeepSpeed stores that optimizer per parameter)"
    elif stage == 1 and engine.bfloat16_enabled():
        what = "bf16 at ZeRO-1 (DeepSpeed's BF16_Optimizer has a format of its own)"
    elif engine.cfg.optimizer.optimizer != "adam":
        what = f"optimizer {engine.cfg.optimizer.optimizer} (only Adam/AdamW state is written)"
    if what:
        raise ConfigError(f"save_checkpoint(format='deepspeed') does not write {what}; save in megazero's "
                          "format (format='megazero') and convert with zero_to_fp32")
    for key, value in client_state.items():
        if key in DS_KEYS:
            raise ConfigError(f"save_checkpoint(format='deepspeed'): client_state key {key!r} is one of "
                              "DeepSpeed's own keys in the checkpoint; rename it")
        bad = not_plain(value)
        if bad is not None:
            raise ConfigError(f"save_checkpoint: client_state[{key!r}] holds a {bad}; a checkpoint holds "
                              "tensors and plain Python values only")
    return stage


def whole_values(engine) -> Dict[str, Dict[str, torch.Tensor]]:
    """key (master, exp_avg, exp_avg_sq) -> parameter name -> its whole flat fp32 value, on every rank
    (collective: each bucket's shards all-gathered over its group)."""
    from megazero.process.distributed import gather_shards
    opt, mesh = engine.zero, engine.mesh
    opt.finish_param_sync()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out: Dict[str, Dict[str, torch.Tensor]] = {k: {} for k in KEYS}
    for b in opt.buckets:
        lo, hi = opt.storage.updated_range(b)
        pieces = [{k: t.detach().reshape(-1).to(torch.float32, copy=True) for k, t in
                   opt.update.piece_tensors(b, j, KEYS).items()} for j in range(len(opt.update.pieces(b)))]
        for k in KEYS:
            local = torch.cat([p[k] for p in pieces])
            if hi - lo != b.numel:
                full = torch.empty(b.numel, dtype=torch.float32, device=local.device)
                gather_shards(full, local, group=mesh.group(*b.group))
                local = full
            local = local.cpu()
            for p, s, shape in zip(b.params, b.starts, b.shapes):
                out[k][names[id(p)]] = local[s:s + shape.numel()].clone()
    return out


def _model_states(engine, groups, client_state: dict, stage: int, rank: int, world: int) -> dict:
    """The model-states file (ZeRO-3: rank ``rank``'s)."""
    from megazero.engine.engine_state import persistent_buffers, tied_names
    shapes = param_shapes(engine)
    params = dict(engine.module.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad]
    buffers = list(persistent_buffers(engine.module))
    dtype = engine.dtype
    if stage == 3:
        names = set(params) | set(tied_names(engine.module))
        module = OrderedDict((k, torch.empty(0, dtype=dtype) if k in names else v.detach().cpu().clone())
                             for k, v in engine.module.state_dict().items())
        fragments = OrderedDict((n, partition(params[n].detach().reshape(-1).cpu(), world, rank))
                                for n in frozen)
    else:
        module = OrderedDict((k, v.detach().cpu().clone()) for k, v in engine.module.state_dict().items())
        fragments = OrderedDict((n, params[n].detach().cpu().clone()) for n in frozen)
    sched = engine.lr_scheduler
    state = {"module": module, "buffer_names": buffers, "optimizer": None,
             "param_shapes": [OrderedDict((n, shapes[n]) for n in g["names"]) for g in groups],
             "frozen_param_shapes": OrderedDict((n, shapes[n]) for n in frozen) if stage >= 2 else None,
             "shared_params": dict(tied_names(engine.module)),
             "frozen_param_fragments": fragments if stage >= 2 else None,
             "lr_scheduler": sched.state_dict() if sched is not None else None,
             "data_sampler": None, "random_ltd": None, "skipped_steps": engine.skipped_steps,
             "global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "dp_world_size": world, "mp_world_size": 1,
             "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
             "ds_config": engine.config.raw, "ds_version": DS_VERSION}
    state.update(client_state)
    return state


def _write(obj, path: str) -> None:
    from megazero.engine.ds_pickle import save_with_foreign
    tmp = path + ".tmp"
    save_with_foreign(obj, tmp)
    os.replace(tmp, path)


def save_deepspeed(engine, path: str, client_state: dict) -> None:
    """Write DeepSpeed's files of this engine into the tag directory ``path`` (collective): every rank
    its optimizer file (and at ZeRO-3 its model-states file), rank 0 the model states at ZeRO 1-2."""
    stage = _check_supported(engine, client_state)  # the same settings, so the same answer, on every rank
    values = whole_values(engine)
    rank, world = engine.global_rank, engine.dp_world_size  # the engine's data parallelism is the world
    groups = param_groups(engine)
    optim = (zero3_files(engine, values, groups, world) if stage == 3
             else zero12_files(engine, values, groups, stage, world))[rank]
    prefix = "bf16_" if engine.bfloat16_enabled() else ""
    os.makedirs(path, exist_ok=True)
    _write({"optimizer_state_dict": optim, "ds_config": engine.config.raw, "ds_version": DS_VERSION},
           os.path.join(path, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    if stage == 3:
        _write(_model_states(engine, groups, client_state, stage, rank, world),
               os.path.join(path, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
    else:
        states = _model_states(engine, groups, client_state, stage, rank, world)
        if rank == 0:
            _write(states, os.path.join(path, "mp_rank_00_model_states.pt"))
    if engine.mesh.is_distributed:
        dist.barrier(group=engine.mesh.world_group)
