"""The engine's checkpoints: DeepSpeed's directory layout, megazero's format inside.

``save_checkpoint(DIR, tag)`` writes ``DIR/<tag>/`` (default tag ``global_step<N>``) as a megazero
checkpoint directory (:mod:`megazero.checkpoint`: every rank writes its slice of the fp32 master
weights and optimizer moments at once, each file checksummed, published atomically as
``DIR/<tag>/iter_<N>/``) and then ``DIR/latest`` naming the tag, as DeepSpeed does.  What is the
engine's own rides in the checkpoint's metadata (``extra["engine"]``): the step counters, the
learning-rate schedule's state and the param groups' rates (restored on load, as DeepSpeed's optimizer
state restores them), ``client_state``, the module's persistent buffers, which parameter
names are tied to which, and the ds_config.  Values JSON cannot hold (tensors, in ``client_state`` or
the buffers) are stored as ``torch.save`` bytes in base64; they must be plain data (tensors, dict,
list, tuple, str, numbers, None), else ``save_checkpoint`` refuses them naming the key.

``load_checkpoint(DIR, tag=None)`` reads the tag ``DIR/latest`` names (none: ``(None, None)``, as
DeepSpeed), at any data-parallel size and ZeRO stage (megazero reshards on load), and returns
``(path, client_state)``.  ``load_optimizer_states=False`` keeps a fresh optimizer; ``load_module_only``
takes the weights alone.  The base64 values are read with ``torch.load(weights_only=True)`` and checked
to be plain data; anything else (a pickle that would call code) is refused with one line naming the
``metadata.json`` and the key, before any of the engine's own state (counters, schedule, buffers) is
restored (the weights and optimizer state are loaded by then: the engine is not to be used further).
The micro-batch counter is derived from the optimizer step and this engine's
``gradient_accumulation_steps`` (not restored), so a resume at another data-parallel size starts a
whole accumulation; the ``train_batch_size`` must be the saved one.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megazero.checkpoint.format import METADATA
from megazero.engine.engine_state import (  # noqa: F401 - public here too
    PLAIN, check_batch, not_plain, persistent_buffers, restore_rates, tag_dir, tied_names)
from megazero.errors import ConfigError

LATEST = "latest"


def encode(obj, key: str) -> Dict[str, Any]:
    """``{"json": obj}`` when JSON holds it, else ``{"torch": base64 of torch.save(obj)}``; ``obj`` must
    be plain data (see :func:`decode`), else ConfigError naming ``key``."""
    try:
        json.dumps(obj)
        return {"json": obj}
    except (TypeError, ValueError):
        pass
    bad = not_plain(obj)
    if bad is not None:
        raise ConfigError(f"save_checkpoint: {key} holds a {bad}; a checkpoint holds tensors and plain "
                          "Python values only (dict, list, tuple, str, int, float, bool, None), which is all "
                          "load_checkpoint reads back")
    buf = io.BytesIO()
    torch.save(obj, buf)
    return {"torch": base64.b64encode(buf.getvalue()).decode("ascii")}


def decode(blob: Optional[Dict[str, Any]], where: str, key: str):
    """A value :func:`encode` wrote: JSON as it is; ``torch.save`` bytes read with ``weights_only=True``
    (torch's unpickler of tensors and plain containers, which calls no other code) and then checked to
    be plain data.  Anything else raises :class:`CheckpointError` naming ``where`` (the file) and
    ``key``: no code runs from a checkpoint."""
    from megazero.checkpoint.errors import CheckpointError
    if not blob:
        return None
    if not isinstance(blob, dict) or len(blob) != 1 or not set(blob) <= {"json", "torch"}:
        raise CheckpointError(f"{where}: {key} is not a value save_checkpoint writes ({{\"json\": ...}} or "
                              "{\"torch\": base64}); the file was altered, or is not megazero's")
    if "json" in blob:
        return blob["json"]
    try:
        data = io.BytesIO(base64.b64decode(str(blob["torch"]), validate=True))
        value = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever the bytes are, one line naming the file and key
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        reason = f"it names {named.group(1)}" if named else f"{type(err).__name__}"
        raise CheckpointError(f"{where}: {key} is refused: not plain data a weights-only load reads "
                              f"({reason}); megazero runs no code from a checkpoint") from None
    bad = not_plain(value)
    if bad is not None:
        raise CheckpointError(f"{where}: {key} is refused: it holds a {bad}, not plain data")
    return value


def _engine_state(engine, client_state) -> Dict[str, Any]:
    sched = engine.lr_scheduler
    buffers = {k: v.detach().to("cpu").clone() for k, v in persistent_buffers(engine.module).items()}
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "train_batch_size": engine.config.train_batch_size,
            "lr_scheduler": encode(sched.state_dict(), "the lr_scheduler's state_dict") if sched is not None
            else None,
            "lrs": [float(g["lr"]) for g in engine.optimizer.param_groups],
            "client_state": encode(client_state, "client_state"),
            "buffers": encode(buffers, "the module's buffers") if buffers else None,
            "tied": tied_names(engine.module), "order": [n for n, _ in engine.module.named_parameters()],
            "frozen": [n for n, p in engine.module.named_parameters() if not p.requires_grad],
            "dp": engine.dp_world_size, "ds_config": engine.config.raw}


def _barrier(engine) -> None:
    if engine.mesh.is_distributed:
        dist.barrier(group=engine.mesh.world_group)


def save_checkpoint(engine, save_dir: str, tag=None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False,
                    format: Optional[str] = None) -> bool:  # noqa: A002 - engine.save_checkpoint's keyword
    """See the module docstring (collective: every rank calls it); ``format="deepspeed"`` (or the
    ds_config's ``checkpoint.format``) writes DeepSpeed's layout instead (:mod:`megazero.engine.ds_save`)."""
    from megazero.checkpoint import save
    from megazero.engine.ds_save import checkpoint_format, save_deepspeed
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    path = tag_dir(save_dir, tag)
    if exclude_frozen_parameters and any(not p.requires_grad for p in engine.module.parameters()):
        raise ConfigError("save_checkpoint(exclude_frozen_parameters=True) is not supported: megazero's "
                          "checkpoints hold every parameter")
    if checkpoint_format(engine, format) == "deepspeed":
        save_deepspeed(engine, path, client_state or {})
    else:
        save(path, engine.global_steps, [engine.module], engine.zero, engine.mesh, engine.cfg,
             extra={"engine": _engine_state(engine, client_state or {})})
    if save_latest and engine.global_rank == 0:
        tmp = os.path.join(save_dir, LATEST + ".tmp")
        with open(tmp, "w") as fh:
            fh.write(str(tag))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST))
    _barrier(engine)
    return True


def _latest_tag(load_dir: str) -> Optional[str]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return fh.read().strip() or None


def checkpoint_path(engine, load_dir: str, tag=None) -> Optional[str]:
    """The directory of tag ``tag`` (default: the one ``latest`` names) under ``load_dir``, or None when
    there is no ``latest`` (said on rank 0)."""
    where = os.path.join(load_dir, LATEST) if tag is None else ""
    tag = _latest_tag(load_dir) if tag is None else tag
    if tag is None:
        if engine.global_rank == 0:
            print(f"[megazero] no checkpoint to load: {os.path.join(load_dir, LATEST)} does not exist",
                  flush=True)
        return None
    return tag_dir(load_dir, tag, where)


def load_checkpoint(engine, path: str, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> Tuple[Optional[str], Optional[dict]]:
    """See the module docstring (collective); ``path``: :func:`checkpoint_path`."""
    from megazero.checkpoint import load
    ck = replace(engine.cfg.checkpoint, finetune=load_module_only, no_load_optim=not load_optimizer_states,
                 override_opt_param_scheduler=True)
    info = load(path, [engine.module], engine.zero, engine.mesh, replace(engine.cfg, checkpoint=ck))
    state = info["extra"].get("engine", {}) if not load_module_only else {}
    meta = saved_engine_state(info["path"]) if load_module_only else state
    where = os.path.join(info["path"], METADATA)
    # every value decoded (and refused, naming the file and key) before the engine's own state changes
    buffers = decode(meta.get("buffers"), where, "buffers") or {}
    sched = decode(state.get("lr_scheduler"), where, "lr_scheduler")
    client = decode(state.get("client_state"), where, "client_state")
    if not load_module_only:
        check_batch(engine, state, where)
    live = persistent_buffers(engine.module)
    with torch.no_grad():
        for name, value in buffers.items():
            if name in live:
                live[name].copy_(value.to(live[name].device, live[name].dtype))
    if not load_module_only:
        engine.global_steps = int(state.get("global_steps", info["iteration"]))
        engine.global_samples = int(state.get("global_samples", 0))
        # from the optimizer step and this run's accumulation, never the saved count: a checkpoint of
        # another data-parallel size counted other micro-batches (the next one starts an accumulation)
        engine.micro_steps = engine.global_steps * engine.config.gradient_accumulation_steps
        engine.skipped_steps = int(state.get("skipped_steps", 0))
        if load_lr_scheduler_states and sched is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(sched)
        if load_optimizer_states or load_lr_scheduler_states:
            restore_rates(engine, state.get("lrs"))
        engine.zero.zero_grad()
    return path, client


def saved_engine_state(iteration_dir: str) -> Dict[str, Any]:
    """The engine's part of a checkpoint's metadata (``iteration_dir``: its ``iter_<N>`` directory)."""
    with open(os.path.join(iteration_dir, METADATA)) as fh:
        return json.load(fh).get("extra", {}).get("engine", {})


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """The whole model's ``state_dict`` in the compute dtype (fp32 without fp16/bf16), written by rank 0
    with ``torch.save`` (collective); ``exclude_frozen_parameters`` leaves out the parameters that do not
    require a gradient.  Under ZeRO-3 only with ``stage3_gather_16bit_weights_on_model_save``
    (DeepSpeed's rule), else nothing is written and it returns False."""
    from megazero.zero.partition import GatheredParameters
    if engine.zero.stage3 is not None and not engine.config.gather_16bit_on_save:
        if engine.global_rank == 0:
            print("[megazero] save_16bit_model: nothing saved under ZeRO-3 without "
                  "zero_optimization.stage3_gather_16bit_weights_on_model_save", flush=True)
        return False
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().to("cpu").clone() for k, v in engine.module.state_dict().items()}
    if exclude_frozen_parameters:
        for name, p in engine.module.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                state.pop(name, None)
    if engine.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, os.path.join(save_dir, save_filename))
    _barrier(engine)
    return True
