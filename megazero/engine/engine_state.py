"""What a checkpoint of the engine and DeepSpeed's layouts both need from a live engine, below
:mod:`megazero.engine.checkpointing` and the DeepSpeed readers and writer (which import it, not each
other): plain-data checks, the persistent buffers, tied parameter names, tag directories, and the
resume checks of the batch schedule and the learning rates."""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, Optional

import torch

from megazero.errors import ConfigError


PLAIN = (str, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


def not_plain(obj, depth: int = 0) -> Optional[str]:
    """The type name of the first value in ``obj`` that is not plain data, else None: tensors
    (``torch.Tensor`` and ``nn.Parameter`` themselves, no other subclass), dict, list, tuple and
    :data:`PLAIN` values, nested at most 100 deep."""
    if depth > 100:
        return "structure nested deeper than 100"
    if type(obj) in (torch.Tensor, torch.nn.Parameter) or type(obj) in PLAIN:
        return None
    if type(obj) in (dict, OrderedDict):
        items = [v for kv in obj.items() for v in kv]
    elif type(obj) in (list, tuple):
        items = obj
    else:
        return type(obj).__module__ + "." + type(obj).__qualname__
    for item in items:
        bad = not_plain(item, depth + 1)
        if bad is not None:
            return bad
    return None


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


def tag_dir(directory: str, tag, where: str = "") -> str:
    """``directory/tag``; ConfigError unless ``tag`` is a plain directory name (``where``: the file it
    was read from, named in the error)."""
    tag = str(tag)
    if not tag or os.sep in tag or tag in (".", ".."):
        source = f" (read from {where})" if where else ""
        raise ConfigError(f"checkpoint tag {tag!r}{source} must be a plain directory name inside {directory}")
    return os.path.join(directory, tag)


def check_batch(engine, state: Dict[str, Any], where: str) -> None:
    """A resume continues the saved run's schedule of samples per optimizer step: ConfigError unless
    this engine's ``train_batch_size`` is the saved one (any data-parallel size, micro-batch and
    accumulation that multiply to it resume exactly)."""
    saved = state.get("train_batch_size")
    if saved is None and state.get("global_steps"):  # checkpoints before the key: samples per step
        saved = int(state.get("global_samples", 0)) // int(state["global_steps"])
    mine = engine.config.train_batch_size
    if saved and int(saved) != mine:
        raise ConfigError(f"{where}: saved with train_batch_size {saved}, this engine's is {mine} "
                          f"(micro {engine.config.micro_batch_size} x accumulation "
                          f"{engine.config.gradient_accumulation_steps} x DP {engine.dp_world_size}); a "
                          f"resume keeps the samples per step: give ds_config train_batch_size {saved}, or "
                          "load_module_only=True to start a new run from the weights")


def restore_rates(engine, rates) -> None:
    """The param groups' learning rates at the save (DeepSpeed restores them with the optimizer's
    param groups): the next update runs at the saved rate, not at a fresh schedule's first one, and a
    chainable torch scheduler (``StepLR``: ``lr *= gamma``) continues from it."""
    groups = engine.optimizer.param_groups
    if rates is None or len(rates) != len(groups):  # older checkpoints; another grouping
        return
    for group, lr in zip(groups, rates):
        group["lr"] = float(lr)
