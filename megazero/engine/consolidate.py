"""``zero_to_fp32``: an engine checkpoint, saved at any data-parallel size and ZeRO stage, as one fp32
``state_dict`` (DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions, same names and arguments).

The weights come from the fp32 master weights every rank saved (:func:`megazero.checkpoint.read_weights`:
the slices joined, every block checked against its checksum); the persistent buffers and the names
of tied parameters from the engine's metadata, so the result loads with ``model.load_state_dict``
(strict).  One process, no model and no process group needed.  Nothing in the checkpoint runs code:
the weights are raw fp32 bytes, the buffers are read by :func:`megazero.engine.checkpointing.decode`
(``torch.load(weights_only=True)``, plain data only, else one line naming the file and key).
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Dict, Optional

import torch

from megazero.checkpoint.format import METADATA
from megazero.engine.checkpointing import LATEST, decode, tag_dir
from megazero.errors import ConfigError

UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10, "MIB": 2 ** 20,
         "GIB": 2 ** 30, "TIB": 2 ** 40}


def _checkpoint(checkpoint_dir: str, tag) -> str:
    """The megazero checkpoint directory of ``tag`` (default: the one ``checkpoint_dir/latest`` names);
    ``checkpoint_dir`` may also be a tag's directory itself."""
    from megazero.checkpoint.format import TRACKER
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, TRACKER)):
        return checkpoint_dir
    latest = ""
    if tag is None:
        latest = os.path.join(checkpoint_dir, LATEST)
        if not os.path.isfile(latest):
            raise ConfigError(f"{checkpoint_dir}: no '{LATEST}' file naming a checkpoint tag; give the tag "
                              "(e.g. global_step10)")
        with open(latest) as fh:
            tag = fh.read().strip()
    return tag_dir(checkpoint_dir, tag, latest)  # a plain directory name, as load_checkpoint takes it


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag=None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> Dict[str, torch.Tensor]:
    """Every parameter's fp32 weight (tied names included, sharing one tensor) and every persistent
    buffer, by the module's own names.  ``lazy_mode`` is accepted (the tensors are always loaded)."""
    from megazero.checkpoint import read_weights
    path = _checkpoint(checkpoint_dir, tag)
    found, meta, _, weights = read_weights(path, flag="checkpoint_dir")
    engine = meta.get("extra", {}).get("engine", {})
    frozen = set(engine.get("frozen", []))
    out: Dict[str, torch.Tensor] = OrderedDict()
    for name in engine.get("order", sorted(weights)):
        if name in weights and not (exclude_frozen_parameters and name in frozen):
            out[name] = weights[name]
    buffers = decode(engine.get("buffers"), os.path.join(found, METADATA), "buffers") or {}
    for name, value in buffers.items():
        out[name] = value
    for alias, name in engine.get("tied", {}).items():
        if name in out:
            out[alias] = out[name]
    return out


def _max_bytes(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B)\s*", str(size).upper())
    if not m:
        raise ConfigError(f"max_shard_size {size!r}: give digits and a unit, e.g. 5GB or 500MB")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def _shards(state: Dict[str, torch.Tensor], limit: int):
    """Names in order, cut into files of at most ``limit`` bytes (a larger tensor gets a file alone)."""
    files, current, size = [], [], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if current and size + n > limit:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    return files + ([current] if current else [])


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Write the consolidated ``state_dict`` into ``output_dir``: ``pytorch_model.bin`` (or
    ``model.safetensors``), cut into numbered files with an index JSON, Hugging Face's layout, when it
    is larger than ``max_shard_size``."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    files = _shards(state, _max_bytes(max_shard_size))
    os.makedirs(output_dir, exist_ok=True)
    names = ([f"{stem}.{ext}"] if len(files) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(files):05d}.{ext}" for i in range(len(files))])
    for fname, keys in zip(names, files):
        part = {k: state[k] for k in keys}
        if safe_serialization:
            from safetensors.torch import save_file
            save_file({k: v.contiguous().clone() for k, v in part.items()}, os.path.join(output_dir, fname),
                      metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(output_dir, fname))
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: fname for fname, keys in zip(names, files) for k in keys}}
        with open(os.path.join(output_dir, f"{stem}.{ext}.index.json"), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: Optional[str] = None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the consolidated fp32 weights into it; returns it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model
