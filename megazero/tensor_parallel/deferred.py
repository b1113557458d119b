"""Deferred initialisation: a model built without memory, initialised one bucket at a time.

Every weight is a pure function of ``(seed, layer, name)``
(:func:`~megazero.tensor_parallel.layers.init_full`), so it need not exist before the optimizer
takes it.  Modules built under ``with torch.device("meta")`` (:func:`build_chunks`: "allocate
nothing") get *deferred* parameters from :func:`new_param`: ordinary parameters of the right shape,
dtype and device whose data is one zero broadcast over that shape (4 bytes; an in-place write into
it fails), which keep the function computing their value as ``initial_value``.  The ZeRO optimizer
computes each bucket's values as it fills its flat buffers (:func:`initial_value`) and points the
parameter at them (:func:`realize`), so a rank never holds its whole model in fp32: under ZeRO-3
only its shard, below it the flat buffer plus one bucket.  The parameter keeps its identity, its
attributes and any hooks registered on it.  Outside the meta context :func:`new_param` makes a
parameter holding the value itself, so both builds agree bitwise.

A provider whose model does not support this (a parameter or buffer left on the meta device, such
as a plain ``nn.Linear``'s, or an error while building, such as copying weights into a deferred
parameter) is built again, in memory (:func:`build_chunks`).
"""
from __future__ import annotations

from itertools import chain
from typing import Callable, List, Sequence

import torch
import torch.nn as nn


def building_deferred() -> bool:
    """Whether modules are being built on the meta device (inside ``with torch.device("meta")``)."""
    return torch.get_default_device().type == "meta"


def new_param(shape: Sequence[int], make: Callable[[], torch.Tensor], device) -> nn.Parameter:
    """A parameter of ``shape`` whose value is ``make()`` (an fp32 CPU tensor of that shape) on
    ``device``; while :func:`building_deferred`, a deferred one (nothing computed, 4 bytes held)."""
    if building_deferred():
        p = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device).expand(tuple(shape)))
        p.initial_value = make
        return p
    value = make()
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"parameter init gave shape {tuple(value.shape)}, expected {tuple(shape)}")
    return nn.Parameter(value.to(device))


def is_deferred(t: torch.Tensor) -> bool:
    """Whether ``t`` is a deferred parameter (its value not computed yet)."""
    return callable(getattr(t, "initial_value", None))


def initial_value(p: torch.Tensor) -> torch.Tensor:
    """``p``'s value: computed now for a deferred parameter (an fp32 CPU tensor), else ``p`` detached."""
    if is_deferred(p):
        return p.initial_value().reshape(p.shape)
    return p.detach()


def realize(p: nn.Parameter, data: torch.Tensor) -> None:
    """The deferred parameter ``p`` holds ``data`` from now on (any shape: the optimizer points it at
    its flat buffers next) and is no longer deferred."""
    p.data = data
    del p.initial_value


def realize_rest(chunks: Sequence[nn.Module], device, dtype: torch.dtype) -> None:
    """Give every parameter still deferred (none the optimizer took: frozen ones) its value."""
    for c in chunks:
        for p in c.parameters():
            if is_deferred(p):
                realize(p, initial_value(p).to(device=device, dtype=dtype))


def build_chunks(model_provider, cfg, mesh, dtype: torch.dtype) -> List[nn.Module]:
    """``model_provider(cfg, mesh)`` built with deferred parameters when its model allows (module
    docstring), else built again in memory and moved to the mesh's device and ``dtype``."""
    try:
        with torch.device("meta"):
            chunks = list(model_provider(cfg, mesh))
        tensors = [t for c in chunks for t in chain(c.parameters(), c.buffers())]
        if all(is_deferred(t) and not t.is_meta for t in tensors):
            return chunks
    except Exception:  # noqa: BLE001 - whatever failed is built again in memory, where it raises if it must
        pass
    from megazero.tensor_parallel.rng import seed_default_generators
    seed_default_generators(cfg.training.seed, mesh)  # as before the first build
    return [c.to(device=mesh.device, dtype=dtype) for c in model_provider(cfg, mesh)]
