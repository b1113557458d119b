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
as a plain ``nn.Linear``'s, one created with its value rather than by :func:`new_param`, or an error
while building, such as copying weights into a deferred parameter) is built again, in memory
(:func:`build_chunks`), with a :class:`DeferredInitWarning` naming the tensors that could not defer
(or the error) and why: that build holds the whole model in memory at once.

A parameter whose dtype module conversions must not change (the MoE router's fp32 expert bias) carries
``fixed_dtype``; :func:`realize_rest` gives it its value in that dtype.
"""
from __future__ import annotations

import traceback
import warnings
from typing import Callable, List, Sequence

import torch
import torch.nn as nn


class DeferredInitWarning(UserWarning):
    """A model could not be built with deferred parameters and was built in memory instead."""


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
    """Give every parameter still deferred (none the optimizer took: frozen ones) its value, in
    ``dtype`` or the parameter's own ``fixed_dtype``."""
    for c in chunks:
        for p in c.parameters():
            if is_deferred(p):
                realize(p, initial_value(p).to(device=device, dtype=getattr(p, "fixed_dtype", dtype)))


def not_deferred(chunks: Sequence[nn.Module]) -> List[str]:
    """``"<name> (<why>)"`` for each parameter or buffer of ``chunks`` that is not deferred."""
    out = []
    for i, c in enumerate(chunks):
        tensors = [("parameter", n, t) for n, t in c.named_parameters()]
        tensors += [("buffer", n, t) for n, t in c.named_buffers()]
        for kind, name, t in tensors:
            if t.is_meta:
                why = "left on the meta device: not created by new_param"
            elif not is_deferred(t):
                why = "created with its value under the meta device: not by new_param"
            else:
                continue
            out.append(f"chunk {i} {kind} {name} ({why})")
    return out


def _raised_at(e: BaseException) -> str:
    """``file:line`` of the innermost frame of ``e``'s traceback outside torch (the model's code)."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/torch/" not in f.filename] or frames
    return f"{ours[-1].filename}:{ours[-1].lineno}" if ours else "?"


def build_chunks(model_provider, cfg, mesh, dtype: torch.dtype) -> List[nn.Module]:
    """``model_provider(cfg, mesh)`` built with deferred parameters when its model allows (module
    docstring), else built again in memory and moved to the mesh's device and ``dtype``, with a
    :class:`DeferredInitWarning` that says why."""
    try:
        with torch.device("meta"):
            chunks = list(model_provider(cfg, mesh))
        missing = not_deferred(chunks)
        if not missing:
            return chunks
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        reason = f"{len(missing)} tensors could not defer: {'; '.join(missing[:3])}{more}"
    except Exception as e:  # noqa: BLE001 - built again in memory, where it raises if it must
        reason = f"building on the meta device raised {type(e).__name__}: {e} (at {_raised_at(e)})"
    warnings.warn(f"deferred initialisation: {reason}; the model is built again in memory, whole",
                  DeferredInitWarning, stacklevel=2)
    from megazero.tensor_parallel.rng import seed_default_generators
    seed_default_generators(cfg.training.seed, mesh)  # as before the first build
    return [c.to(device=mesh.device, dtype=dtype) for c in model_provider(cfg, mesh)]
