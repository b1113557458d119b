"""Megatron-LM's DistributedOptimizer state in its bucket-space formats, by the model's names.

Two formats store the state as flat buffers in the saving run's DDP layout:

    torch_dist ``dp_reshardable`` (recent Megatron-LM's default with --use-distributed-optimizer):
        optimizer.distributed.dp_group_idx_<d>.gbuf_idx_<g>.dtype_<..>.bucket_idx_<b>.{param,exp_avg,
        exp_avg_sq}: one 1-D tensor per bucket (its unpadded length); the parameter groups (their
        ``step``) in the ShardedObject optimizer.distributed.dp_group_idx_<d>.optimizer
    legacy     each mp_rank_*/distrib_optim.pt: {gbuf_idx: {dtypes: {param, exp_avg, exp_avg_sq}}}, a
        buffer's buckets concatenated without their end padding; the groups in model_optim_rng.pt

Inside a bucket megatron-core places the parameters in reverse model order, each at an offset padded
to 64 elements from the bucket's start.  Rather than re-deriving megatron-core's parameter order and
bucket sizes, the layout is found from the data: the ``param`` buffer holds the fp32 main weights, and
at each aligned offset exactly one of the stored model weights (cast to its stored dtype) must equal
the slice there.  Every placement is checked over the whole tensor, every element of the buffer is
accounted for (only the 64-element alignment gaps skipped), and two weights with the same values at
one offset are refused, so a layout that cannot be reconstructed is refused by name, never read wrong.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.optim_legacy import FRESH

ALIGN = 64  # megatron-core pads each parameter's start in a bucket to 64 elements
KINDS = ("param", "exp_avg", "exp_avg_sq")
DIST = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)\.bucket_idx_(\d+)"
                  r"\.(param|exp_avg|exp_avg_sq)$")
PRINT = 16  # elements of a weight's start that index it


def _key(t: torch.Tensor) -> bytes:
    return t.reshape(-1)[:PRINT].float().numpy().tobytes()


class _Units:
    """The model weights a buffer may hold: ``unit -> (reader, shape, dtype)``, indexed by their first
    elements."""

    def __init__(self, units: Dict[object, Tuple[object, tuple, torch.dtype]]):
        self.units = units
        self.index: Dict[Tuple[int, torch.dtype], Dict[bytes, List[object]]] = {}
        for unit, (read, shape, dtype) in units.items():
            w = read()
            self.index.setdefault((min(PRINT, w.numel()), dtype), {}).setdefault(_key(w), []).append(unit)

    def at(self, buf: torch.Tensor, pos: int, taken, where: str) -> Optional[Tuple[object, int]]:
        """The one weight stored at ``pos`` of ``buf`` (checked whole), or None."""
        found = []
        for (k, dtype), table in self.index.items():
            if pos + k > buf.numel():
                continue
            for unit in table.get(_key(buf[pos:pos + k].to(dtype)), []):
                read, shape, _ = self.units[unit]
                n = int(torch.Size(shape).numel())
                if unit in taken or pos + n > buf.numel():
                    continue
                if torch.equal(buf[pos:pos + n].to(dtype).float(), read().reshape(-1).float()):
                    found.append((unit, n))
        if len(found) > 1:
            raise CheckpointError(f"{where}: the weights {found[0][0]} and {found[1][0]} are equal, so the "
                                  "distributed optimizer's buffer cannot tell which state is whose" + FRESH)
        return found[0] if found else None


def place(buckets: List[torch.Tensor], units: _Units, where: str, joined: bool) -> Dict[object, tuple]:
    """``unit -> (bucket index, offset, numel)`` for the ``param`` buffers ``buckets``.  ``joined``: a
    legacy buffer (its buckets concatenated, their boundaries unknown: a parameter may also start a new
    bucket right where the previous one ended)."""
    out: Dict[object, tuple] = {}
    for b, buf in enumerate(buckets):
        start, cursor = 0, 0
        while cursor < buf.numel():
            aligned = start + -(-(cursor - start) // ALIGN) * ALIGN
            hit = units.at(buf, aligned, out.keys(), where) if aligned < buf.numel() else None
            if hit is None and joined and aligned != cursor:
                hit = units.at(buf, cursor, out.keys(), where)
                if hit is not None:
                    start, aligned = cursor, cursor
            if hit is None:
                raise CheckpointError(f"{where}: no stored weight equals the distributed optimizer's main "
                                      f"weights at element {cursor} of bucket {b}; its layout cannot be "
                                      "reconstructed (save it with --dist-ckpt-optim-fully-reshardable)"
                                      + FRESH)
            unit, n = hit
            out[unit] = (b, aligned, n)
            cursor = aligned + n
    return out


class DistTorchBuckets:
    """torch_dist ``dp_reshardable``: ``view(kind)`` has the checkpoint's interface (``has``,
    ``tensor(name, layer=)``) under the model's names."""

    def __init__(self, ck):
        self.ck = ck
        found: Dict[tuple, Dict[str, str]] = {}
        for name in ck.shapes:
            m = DIST.match(name)
            if m:
                found.setdefault((int(m.group(1)), int(m.group(2)), int(m.group(4))), {})[m.group(5)] = name
        groups = sorted({d for d, _, _ in found})
        if groups != [0]:
            raise CheckpointError(f"--load {ck.directory}: the distributed optimizer's dp_reshardable state "
                                  f"spans {len(groups)} tensor/pipeline-parallel domains; megazero reads it "
                                  "from a TP 1 x PP 1 run only (save it with "
                                  "--dist-ckpt-optim-fully-reshardable)" + FRESH)
        self.buckets = [found[k] for k in sorted(found)]
        for names in self.buckets:
            if set(names) != set(KINDS):
                raise CheckpointError(f"--load {ck.directory}: a bucket of the distributed optimizer's state "
                                      f"lacks {sorted(set(KINDS) - set(names))}" + FRESH)
        units = {}
        for name, shape in ck.shapes.items():
            if name.startswith("optimizer.") or not shape:
                continue
            dtype = ck.meta.state_dict_metadata[name].properties.dtype
            if name.startswith("decoder.layers."):
                for i in range(shape[0]):
                    units[(name, i)] = (lambda n=name, i=i: ck.tensor(n, layer=i), shape[1:], dtype)
            else:
                units[(name, None)] = (lambda n=name: ck.tensor(n), shape, dtype)
        params = [ck.tensor(b["param"]) for b in self.buckets]
        self.where = f"--load {ck.directory}"
        self.placed = place(params, _Units(units), self.where, joined=False)
        self.shapes = {u: units[u][1] for u in self.placed}
        self._cache: Dict[str, torch.Tensor] = {}

    def _flat(self, kind: str, b: int) -> torch.Tensor:
        name = self.buckets[b][kind]
        if name not in self._cache:
            self._cache.clear()
            self._cache[name] = self.ck.tensor(name)
        return self._cache[name]

    def has(self, name: str) -> bool:
        return (name, None) in self.placed or (name, 0) in self.placed

    def get(self, kind: str, name: str, layer: Optional[int]) -> torch.Tensor:
        if layer is None and (name, 0) in self.placed:
            return torch.stack([self.get(kind, name, i) for i in range(self.ck.shapes[name][0])])
        unit = (name, layer)
        if unit not in self.placed:
            raise CheckpointError(f"{self.where}: the distributed optimizer holds no {kind} for {name}"
                                  + (f" (layer {layer})" if layer is not None else "") + FRESH)
        b, at, n = self.placed[unit]
        return self._flat(kind, b)[at:at + n].view(self.shapes[unit]).clone()

    def view(self, kind: str) -> "BucketView":
        return BucketView(self, kind)


class BucketView:
    """One kind of :class:`DistTorchBuckets`' state with a checkpoint's interface."""

    def __init__(self, buckets: DistTorchBuckets, kind: str):
        self.b, self.kind = buckets, kind
        ck = buckets.ck
        self.format, self.directory, self.path = ck.format, ck.directory, ck.path

    def has(self, name: str) -> bool:
        return self.b.has(name)

    def tensor(self, name: str, glu: bool = False, layer: Optional[int] = None) -> torch.Tensor:
        return self.b.get(self.kind, name, layer)


def dist_step_and_groups(ck) -> Tuple[Optional[int], list]:
    """The step and parameter groups of torch_dist ``dp_reshardable`` (the ShardedObject
    optimizer.distributed.dp_group_idx_0.optimizer)."""
    import io
    for index, info in ck.meta.storage_data.items():
        if index.fqn.startswith("optimizer.distributed.dp_group_idx_0.optimizer/"):
            fpath = os.path.join(ck.path, info.relative_path)
            with open(fpath, "rb") as fh:
                fh.seek(info.offset)
                data = fh.read(info.length)
            try:
                obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception:  # noqa: BLE001 - damaged or not plain data
                raise CheckpointError(f"{fpath}: the distributed optimizer's parameter groups cannot be "
                                      "read" + FRESH) from None
            obj = obj[0] if isinstance(obj, list) and obj else obj
            groups = (obj or {}).get("param_groups") or [] if isinstance(obj, dict) else []
            steps = [g.get("step") for g in groups if g.get("step") is not None]
            return (int(float(steps[0])) if steps else None), groups
    return None, []


class LegacyBuckets:
    """Legacy ``distrib_optim.pt`` files: ``fetcher(kind)`` as :class:`~.optim_legacy.LegacyOptimizer`'s
    (each rank file's state of a model key)."""

    def __init__(self, ck):
        from megazero.checkpoint.megatron.safe_load import load_pt
        self.ck = ck
        self._by_rank: Dict[Tuple[int, int], Dict[str, Dict[str, torch.Tensor]]] = {}
        self._load = load_pt

    def fetcher(self, kind: str):
        def fetch(t: int, p: int, key: str) -> torch.Tensor:
            state = self.rank_state(t, p).get(key)
            if state is None:
                raise CheckpointError(f"{self._file(t, p)}: the distributed optimizer holds no {kind} for "
                                      f"{key}" + FRESH)
            return state[kind]
        return fetch

    def _file(self, t: int, p: int) -> str:
        return os.path.join(os.path.dirname(self.ck._files[(t, p)]), "distrib_optim.pt")

    def rank_state(self, t: int, p: int) -> Dict[str, Dict[str, torch.Tensor]]:
        if (t, p) not in self._by_rank:
            if len(self._by_rank) >= max(2, getattr(self.ck, "tp", 1)):
                self._by_rank.pop(next(iter(self._by_rank)))
            self._by_rank[(t, p)] = self._read(t, p)
        return self._by_rank[(t, p)]

    def _read(self, t: int, p: int) -> Dict[str, Dict[str, torch.Tensor]]:
        fpath = self._file(t, p)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{fpath} is missing (the checkpoint's other ranks hold distrib_optim.pt)"
                                  + FRESH)
        saved = self._load(fpath)
        if not isinstance(saved, dict) or not saved.get("buckets_coalesced"):
            raise CheckpointError(f"{fpath}: an older distrib_optim.pt layout (buckets not coalesced), "
                                  "which megazero does not read" + FRESH)
        buffers = []
        for g in sorted(k for k in saved if isinstance(k, int)):
            for dtypes, state in saved[g].items():
                if not all(torch.is_tensor(state.get(k)) for k in KINDS):
                    raise CheckpointError(f"{fpath}: buffer {g} {dtypes} lacks one of {KINDS}" + FRESH)
                buffers.append(state)
        model = self.ck._rank(t, p)["model"]
        units = {k: (lambda v=v: v, tuple(v.shape), v.dtype) for k, v in model.items()
                 if torch.is_tensor(v) and not k.endswith("_extra_state")}
        placed = place([s["param"].float() for s in buffers], _Units(units), fpath, joined=True)
        out = {}
        for key, (b, at, n) in placed.items():
            shape = units[key][1]
            out[key] = {kind: buffers[b][kind][at:at + n].float().view(shape).clone() for kind in KINDS}
        return out


def legacy_step_and_groups(ck) -> Tuple[Optional[int], list]:
    """The step and parameter groups a distributed-optimizer run's ``model_optim_rng.pt`` holds."""
    opt = ck._rank(0, 0).get("optimizer")
    inner = opt.get("optimizer") if isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict) else opt
    groups = (inner or {}).get("param_groups") or [] if isinstance(inner, dict) else []
    steps = [g.get("step") for g in groups if g.get("step") is not None]
    return (int(float(steps[0])) if steps else None), groups


def has_legacy_files(ck) -> bool:
    return ck.format == "torch" and any(os.path.isfile(os.path.join(os.path.dirname(f), "distrib_optim.pt"))
                                        for f in ck._files.values())
