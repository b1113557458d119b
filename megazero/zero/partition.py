"""``zero.Init`` (build a model already partitioned) and ``GatheredParameters`` (its full weights).

:class:`Init` is a context manager.  While it is active every parameter created (any module's
``register_parameter``) is recorded, and as soon as its module is attached to a parent (the moment
the module's own ``__init__`` has finished and the parent's goes on) its values are made the same on
every data-parallel rank (broadcast from rank 0, as DeepSpeed does) and each rank keeps only its
slice of the flattened parameter, ``p.zero_shard`` (``ceil(numel / dp)`` elements, the last padded);
``p.data`` becomes an empty tensor and ``p.zero_shape`` records the shape.  Leaving the block
partitions what is left (the top module's own parameters).  So a rank never holds more than its
slice of the model plus the parameters of the one module being built.  ``Init(module=model)``
partitions a model built before.  ``initialize`` assembles the ZeRO buckets from the slices one
bucket at a time (:func:`bucket_values`).

As with DeepSpeed, code that writes a parameter after its module was attached (a parent's
``__init__`` re-initialising its children, Hugging Face's ``post_init``) writes into an empty tensor:
wrap such code in ``GatheredParameters(params, modifier_rank=0)``.

:class:`GatheredParameters` gives the full values of partitioned parameters inside the block:
parameters still under ``Init`` are all-gathered from their slices; parameters the engine holds
under ZeRO-3 have their units gathered (:class:`~megazero.zero.stage3.Stage3Params`); under ZeRO
0-2 they are whole already.  With ``modifier_rank`` set, what that rank holds when the block ends is
broadcast and written back: into the slices, or into the engine's fp32 master weights (and from
them the parameters).  Both are collective: every rank enters the same blocks in the same order.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.modules.module as module_hooks

from megazero.process.distributed import all_gather_single
from megazero.errors import ConfigError
from megazero.mesh import collective_device


def _dp() -> tuple:
    """(group, size, rank) of the data-parallel ranks: the whole world, as the engine uses it."""
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    return None, 1, 0


def _comm_device() -> torch.device:
    """Where collectives run: the current GPU under NCCL, else the CPU."""
    return collective_device(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                             else torch.device("cpu"))


def partition(p: torch.nn.Parameter) -> None:
    """Keep this rank's slice of ``p`` (values broadcast from rank 0 first); ``p.data`` becomes empty."""
    if hasattr(p, "zero_shard"):
        return
    group, size, rank = _dp()
    full = p.detach()
    if size > 1:
        full = full.to(_comm_device()).contiguous()
        dist.broadcast(full, src=0, group=group)
    flat = full.reshape(-1)
    k = -(-flat.numel() // size)
    shard = torch.zeros(k, dtype=flat.dtype, device="cpu")  # host memory until initialize()
    piece = flat[rank * k:(rank + 1) * k]
    shard[:piece.numel()].copy_(piece)
    p.zero_shape, p.zero_shard = p.shape, shard
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def gather_full(p: torch.nn.Parameter) -> torch.Tensor:
    """The whole value of a parameter partitioned by :class:`Init` (collective over the DP ranks)."""
    group, size, _ = _dp()
    shard = p.zero_shard.to(_comm_device())
    if size == 1:
        flat = shard
    else:
        flat = torch.empty(shard.numel() * size, dtype=shard.dtype, device=shard.device)
        all_gather_single(flat, shard, group=group)
    return flat[:p.zero_shape.numel()].view(p.zero_shape)


def bucket_values(b, device) -> torch.Tensor:
    """Bucket ``b``'s parameters as one padded fp32 tensor, gathering those partitioned by :class:`Init`
    (collective; for :func:`megazero.zero.build_optimizer`'s ``values``)."""
    full = torch.zeros(b.numel, dtype=torch.float32, device=device)
    for p, s, shape in zip(b.params, b.starts, b.shapes):
        value = gather_full(p) if hasattr(p, "zero_shard") else p.detach()
        full[s:s + shape.numel()].copy_(value.reshape(-1))
    return full


def release(p: torch.nn.Parameter) -> None:
    """Forget the :class:`Init` slice of a parameter whose values now live elsewhere."""
    for name in ("zero_shard", "zero_shape"):
        if hasattr(p, name):
            delattr(p, name)


class Init:
    """Build a model already partitioned over the data-parallel ranks (see the module docstring).

    DeepSpeed's arguments are accepted: ``module`` (partition a model built before), ``enabled``;
    ``config_dict_or_path``, ``config``, ``dtype``, ``pin_memory``, ``mem_efficient_linear`` and
    ``data_parallel_group`` (the whole world, the only group the engine uses) change nothing (the
    slices keep the dtype the parameters were made in; ``initialize`` makes the fp32 masters and the
    compute-dtype copies); ``remote_device`` may be None or cpu."""

    def __init__(self, module: Optional[torch.nn.Module] = None, data_parallel_group=None,
                 mem_efficient_linear: bool = True, remote_device=None, pin_memory: bool = False,
                 config_dict_or_path=None, config=None, enabled: bool = True, dtype=None, mpu=None):
        if mpu is not None:
            raise ConfigError("zero.Init(mpu=...): model parallelism is not supported by megazero's engine")
        if remote_device not in (None, "cpu", "none"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}) is not supported: until "
                              "initialize() the slices live in host memory (remote_device None or cpu)")
        if data_parallel_group not in (None, getattr(dist.group, "WORLD", None)):
            raise ConfigError("zero.Init(data_parallel_group=...): the engine's data-parallel group is the "
                              "whole world")
        self.enabled = enabled
        self.created: Dict[int, torch.nn.Parameter] = {}
        self.handles: list = []
        if module is not None and enabled:
            for p in module.parameters():
                partition(p)

    def _on_parameter(self, module, name, param):
        if param is not None:
            self.created[id(param)] = param

    def _on_module(self, parent, name, child):
        if child is not None:
            for p in child.parameters():
                if id(p) in self.created:
                    partition(p)

    def __enter__(self):
        if self.enabled:
            self.handles = [module_hooks.register_module_parameter_registration_hook(self._on_parameter),
                            module_hooks.register_module_module_registration_hook(self._on_module)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        if exc[0] is None:
            for p in list(self.created.values()):
                partition(p)
        self.created = {}
        return False


class GatheredParameters:
    """Full values of partitioned parameters inside the block (see the module docstring)."""

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params: List[torch.nn.Parameter] = list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self.engine_units: list = []

    def __enter__(self):
        for p in self.params:
            if hasattr(p, "zero_shard"):
                p.data = gather_full(p).clone()
        owners = _owners(self.params)
        for zero, params in owners.values():
            zero.finish_param_sync()
            if zero.stage3 is not None:
                units = {zero.stage3.units[b.unit] for b in _buckets_of(zero, params)}
                for u in sorted(units, key=lambda u: u.index):
                    zero.stage3.gather(u)
                self.engine_units.append((zero, units))
        return self.params

    def __exit__(self, *exc):
        group, size, _ = _dp()
        if exc[0] is None and self.modifier_rank is not None:
            for p in self.params:
                if size > 1:
                    value = p.data.contiguous()
                    dist.broadcast(value, src=self.modifier_rank, group=group)
                    p.data.copy_(value)
            for zero, params in _owners(self.params).values():
                write_back(zero, {p: p.detach() for p in params})
        for p in self.params:
            if hasattr(p, "zero_shard"):
                if exc[0] is None and self.modifier_rank is not None:
                    _, _, rank = _dp()
                    k = p.zero_shard.numel()
                    piece = p.detach().reshape(-1)[rank * k:(rank + 1) * k]
                    p.zero_shard[:piece.numel()].copy_(piece)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for zero, units in self.engine_units:
            for u in units:
                zero.stage3.free(u)
        self.engine_units = []
        return False


def _owners(params) -> Dict[int, tuple]:
    """id(ZeRO optimizer) -> (optimizer, its parameters among ``params``)."""
    out: Dict[int, tuple] = {}
    for p in params:
        ref = getattr(p, "zero_owner", None)
        zero = ref() if ref is not None else None
        if zero is not None:
            out.setdefault(id(zero), (zero, []))[1].append(p)
    return out


def _buckets_of(zero, params) -> list:
    ids = {id(p) for p in params}
    return [b for b in zero.buckets if any(id(p) in ids for p in b.params)]


def own(zero) -> None:
    """Mark every parameter of a ZeRO optimizer as owned by it (for :class:`GatheredParameters`)."""
    ref = weakref.ref(zero)
    for b in zero.buckets:
        for p in b.params:
            p.zero_owner = ref


def write_back(zero, values: Dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """Write full parameter values into a ZeRO optimizer's fp32 masters (this rank's updated range of
    every bucket they are in), then republish the parameters from the masters (collective over DP)."""
    update, storage = zero.update, zero.storage
    for b in _buckets_of(zero, list(values)):
        lo, _ = storage.updated_range(b)
        storage.begin_update(b)
        for j, (a, e) in enumerate(update.pieces(b)):
            master = update.piece_tensors(b, j, ["master"], read=True)
            with torch.no_grad():
                for p, s, shape in zip(b.params, b.starts, b.shapes):
                    if p not in values:
                        continue
                    x0, x1 = max(lo + a, s), min(lo + e, s + shape.numel())
                    if x0 < x1:
                        flat = values[p].reshape(-1).to(master["master"].device, torch.float32)
                        master["master"][x0 - lo - a:x1 - lo - a].copy_(flat[x0 - s:x1 - s])
            update.commit_piece(b, j, master)
        zero.publish_params(b)
        storage.end_update(b)
