"""ZeRO-3 gather units for any ``nn.Module``: DeepSpeed's per-submodule fetch.

megazero's ZeRO-3 (:mod:`megazero.zero.stage3`) gathers a *unit*'s parameters around that unit's
forward and backward.  For megazero's GPT a unit is a transformer layer; for an arbitrary model the
engine makes a unit of **every submodule that owns parameters directly** (``module._parameters``: a
``Linear``, an ``Embedding``, a norm, a custom module's own weights), as DeepSpeed fetches each
submodule's parameters around its forward and backward.  The model itself is the *root* unit,
gathered for the model's whole forward and whole backward; it takes what no submodule can own alone:

- a parameter owned by two modules (tied weights: an output head sharing the input embedding);
- a parameter with at most ``persistence_threshold`` elements (DeepSpeed's
  ``stage3_param_persistence_threshold``: DeepSpeed keeps those whole on every rank; megazero keeps
  them sharded between steps like every other parameter, and gathers them once per forward and
  once per backward with the root instead of around each use);
- a parameter marked by :func:`register_external_parameter` (used outside its module's forward).

A submodule that reads another module's parameter outside that module's forward needs the last rule,
as with DeepSpeed.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megazero.zero.buckets import Blocks, full_shape


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Mark ``parameter`` as used outside its own module's forward (DeepSpeed's name): under ZeRO-3 it
    is gathered with the model's root unit, for the whole forward and backward.  Call before
    ``initialize``."""
    parameter.zero_external = True


def module_blocks(persistence_threshold: int = 0) -> Callable[[torch.nn.Module], Blocks]:
    """The unit rule of the module docstring, for :func:`megazero.zero.build_optimizer`'s ``blocks``."""
    def blocks(root: torch.nn.Module) -> Blocks:
        owners: Dict[int, int] = {}
        for m in root.modules():
            for p in m._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        out: Blocks = []
        for m in root.modules():
            if m is root:
                continue
            own: List[torch.nn.Parameter] = [
                p for p in m._parameters.values()
                if p is not None and p.requires_grad and owners[id(p)] == 1
                and not getattr(p, "zero_external", False) and full_shape(p).numel() > persistence_threshold]
            if own:
                out.append((m, own))
        return out
    return blocks
