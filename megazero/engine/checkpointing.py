"""The engine's checkpoints: DeepSpeed's directory layout, megazero's format inside.

``save_checkpoint(DIR, tag)`` writes ``DIR/<tag>/`` (default tag ``global_step<N>``) as a megazero
checkpoint directory (:mod:`megazero.checkpoint`: every rank writes its slice of the fp32 master
weights and optimizer moments at once, each file checksummed, published atomically as
``DIR/<tag>/iter_<N>/``) and then ``DIR/latest`` naming the tag, as DeepSpeed does.  What is the
engine's own rides in the checkpoint's metadata (``extra["engine"]``): the step counters, the
learning-rate schedule's state, ``client_state``, the module's persistent buffers, which parameter
names are tied to which, and the ds_config.  Values JSON cannot hold (tensors, in ``client_state`` or
the buffers) are stored as ``torch.save`` bytes in base64.

``load_checkpoint(DIR, tag=None)`` reads the tag ``DIR/latest`` names (none: ``(None, None)``, as
DeepSpeed), at any data-parallel size and ZeRO stage (megazero reshards on load), and returns
``(path, client_state)``.  ``load_optimizer_states=False`` keeps a fresh optimizer; ``load_module_only``
takes the weights alone.
"""
from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megazero.errors import ConfigError

LATEST = "latest"


def encode(obj) -> Dict[str, Any]:
    """``{"json": obj}`` when JSON holds it, else ``{"torch": base64 of torch.save(obj)}``."""
    try:
        json.dumps(obj)
        return {"json": obj}
    except (TypeError, ValueError):
        buf = io.BytesIO()
        torch.save(obj, buf)
        return {"torch": base64.b64encode(buf.getvalue()).decode("ascii")}


def decode(blob: Optional[Dict[str, Any]], weights_only: bool = False):
    if not blob:
        return None
    if "json" in blob:
        return blob["json"]
    data = io.BytesIO(base64.b64decode(blob["torch"]))
    return torch.load(data, map_location="cpu", weights_only=weights_only)


def persistent_buffers(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The buffers a ``state_dict`` holds (persistent ones), by name."""
    out = {}
    for prefix, m in module.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def tied_names(module: torch.nn.Module) -> Dict[str, str]:
    """Every parameter name that repeats a parameter seen under an earlier name -> that name."""
    first, out = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def _tag_dir(directory: str, tag) -> str:
    tag = str(tag)
    if not tag or os.sep in tag or tag in (".", ".."):
        raise ConfigError(f"checkpoint tag {tag!r} must be a plain directory name")
    return os.path.join(directory, tag)


def _engine_state(engine, client_state) -> Dict[str, Any]:
    sched = engine.lr_scheduler
    buffers = {k: v.detach().to("cpu").clone() for k, v in persistent_buffers(engine.module).items()}
    return {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps,
            "lr_scheduler": encode(sched.state_dict()) if sched is not None else None,
            "client_state": encode(client_state), "buffers": encode(buffers) if buffers else None,
            "tied": tied_names(engine.module), "order": [n for n, _ in engine.module.named_parameters()],
            "frozen": [n for n, p in engine.module.named_parameters() if not p.requires_grad],
            "dp": engine.dp_world_size, "ds_config": engine.config.raw}


def _barrier(engine) -> None:
    if engine.mesh.is_distributed:
        dist.barrier(group=engine.mesh.world_group)


def save_checkpoint(engine, save_dir: str, tag=None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """See the module docstring (collective: every rank calls it)."""
    from megazero.checkpoint import save
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    path = _tag_dir(save_dir, tag)
    if exclude_frozen_parameters and any(not p.requires_grad for p in engine.module.parameters()):
        raise ConfigError("save_checkpoint(exclude_frozen_parameters=True) is not supported: megazero's "
                          "checkpoints hold every parameter")
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


def load_checkpoint(engine, load_dir: str, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> Tuple[Optional[str], Optional[dict]]:
    """See the module docstring (collective)."""
    from megazero.checkpoint import load
    tag = _latest_tag(load_dir) if tag is None else tag
    if tag is None:
        if engine.global_rank == 0:
            print(f"[megazero] no checkpoint to load: {os.path.join(load_dir, LATEST)} does not exist",
                  flush=True)
        return None, None
    path = _tag_dir(load_dir, tag)
    ck = replace(engine.cfg.checkpoint, finetune=load_module_only, no_load_optim=not load_optimizer_states,
                 override_opt_param_scheduler=True)
    info = load(path, [engine.module], engine.zero, engine.mesh, replace(engine.cfg, checkpoint=ck))
    state = info["extra"].get("engine", {}) if not load_module_only else {}
    meta = saved_engine_state(info["path"]) if load_module_only else state
    buffers = decode(meta.get("buffers"), weights_only=True) or {}
    live = persistent_buffers(engine.module)
    with torch.no_grad():
        for name, value in buffers.items():
            if name in live:
                live[name].copy_(value.to(live[name].device, live[name].dtype))
    if not load_module_only:
        engine.global_steps = int(state.get("global_steps", info["iteration"]))
        engine.global_samples = int(state.get("global_samples", 0))
        engine.micro_steps = int(state.get("micro_steps", 0))
        engine.skipped_steps = int(state.get("skipped_steps", 0))
        sched = decode(state.get("lr_scheduler"))
        if load_lr_scheduler_states and sched is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(sched)
        engine.zero.zero_grad()
    return path, decode(state.get("client_state"))


def saved_engine_state(iteration_dir: str) -> Dict[str, Any]:
    """The engine's part of a checkpoint's metadata (``iteration_dir``: its ``iter_<N>`` directory)."""
    from megazero.checkpoint.format import METADATA
    with open(os.path.join(iteration_dir, METADATA)) as fh:
        return json.load(fh).get("extra", {}).get("engine", {})


def save_16bit_model(engine, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
    """The whole model's ``state_dict`` in the compute dtype, written by rank 0 (collective).  Under
    ZeRO-3 only with ``stage3_gather_16bit_weights_on_model_save`` (DeepSpeed's rule), else False."""
    from megazero.engine.partition import GatheredParameters
    if engine.zero.stage3 is not None and not engine.config.gather_16bit_on_save:
        if engine.global_rank == 0:
            print("[megazero] save_16bit_model: nothing saved under ZeRO-3 without "
                  "zero_optimization.stage3_gather_16bit_weights_on_model_save", flush=True)
        return False
    with GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().to("cpu").clone() for k, v in engine.module.state_dict().items()}
    if engine.global_rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, os.path.join(save_dir, save_filename))
    _barrier(engine)
    return True
