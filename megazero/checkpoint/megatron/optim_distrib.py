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
Under TP/PP each domain (``dp_group_idx_<d>``; a legacy rank file) holds its ranks' local
parameters and is placed against those weights; the pieces are joined as the weights are.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.files import stored_bytes
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
    ``tensor(name, layer=)``) under the model's names.  Each tensor/pipeline-parallel domain
    (``dp_group_idx_<d>``) holds its ranks' local parameters: the stored chunks of the model's tensors
    (a SwiGLU ``linear_fc1``'s local parameter is its gate chunk over its up chunk), placed per domain;
    a chunk replicated over domains (a norm under TP) is taken from the first."""

    def __init__(self, ck):
        self.ck = ck
        found: Dict[int, Dict[tuple, Dict[str, str]]] = {}
        for name in ck.shapes:
            m = DIST.match(name)
            if m:
                key = (int(m.group(2)), int(m.group(4)))
                found.setdefault(int(m.group(1)), {}).setdefault(key, {})[m.group(5)] = name
        self.where = f"--load {ck.directory}"
        self.domains = [[found[d][k] for k in sorted(found[d])] for d in sorted(found)]
        for buckets in self.domains:
            for names in buckets:
                if set(names) != set(KINDS):
                    raise CheckpointError(f"{self.where}: a bucket of the distributed optimizer's state "
                                          f"lacks {sorted(set(KINDS) - set(names))}" + FRESH)
        self._read_cache: Dict[tuple, torch.Tensor] = {}
        self.units = self._units()
        index = _Units(self.units)
        self.placed = [place([ck.tensor(b["param"]) for b in buckets], index, self.where, joined=False)
                       for buckets in self.domains]
        self._cache: Dict[str, torch.Tensor] = {}

    def _whole(self, name: str, layer: Optional[int]) -> torch.Tensor:
        key = (name, layer)
        if key not in self._read_cache:
            self._read_cache.clear()
            self._read_cache[key] = self.ck.tensor(name, layer=layer) if layer is not None \
                else self.ck.tensor(name)
        return self._read_cache[key]

    def _units(self) -> Dict[object, tuple]:
        """``(name, layer, boxes) -> (reader, shape, dtype)``: every local parameter the domains may
        hold; ``boxes``: the ``(offsets, sizes)`` in the tensor (a layer of it) its rows come from."""
        glu = bool(self.ck.args is not None and getattr(self.ck.args, "swiglu", False))
        units = {}
        for name, shape in self.ck.shapes.items():
            if name.startswith("optimizer.") or not shape:
                continue
            props = self.ck.meta.state_dict_metadata[name]
            stacked = name.startswith("decoder.layers.")
            boxes = sorted({(tuple(c.offsets)[stacked:], tuple(c.sizes)[stacked:]) for c in props.chunks})
            if glu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")) and len(boxes) % 2 == 0:
                half = len(boxes) // 2  # rank r's parameter: gate chunk r over up chunk r
                groups = [(boxes[r], boxes[r + half]) for r in range(half)]
            else:
                groups = [(box,) for box in boxes]
            for layer in (range(shape[0]) if stacked else [None]):
                for group in groups:
                    rows = sum(box[1][0] for box in group)
                    local = (rows,) + group[0][1][1:]

                    def read(n=name, i=layer, g=group):
                        return torch.cat([self._box(self._whole(n, i), b) for b in g])
                    units[(name, layer, group)] = (read, local, props.properties.dtype)
        return units

    @staticmethod
    def _box(t: torch.Tensor, box) -> torch.Tensor:
        for d, (at, size) in enumerate(zip(*box)):
            t = t.narrow(d, at, size)
        return t

    def _flat(self, kind: str, d: int, b: int) -> torch.Tensor:
        name = self.domains[d][b][kind]
        if name not in self._cache:  # one bucket a domain kept: a tensor's pieces are read in turn
            if len(self._cache) >= len(self.domains):
                self._cache.pop(next(iter(self._cache)))
            self._cache[name] = self.ck.tensor(name)
        return self._cache[name]

    def has(self, name: str) -> bool:
        return any(u[0] == name for placed in self.placed for u in placed)

    def get(self, kind: str, name: str, layer: Optional[int]) -> torch.Tensor:
        shape = self.ck.shapes[name]
        if layer is None and name.startswith("decoder.layers."):
            return torch.stack([self.get(kind, name, i) for i in range(shape[0])])
        if name.startswith("decoder.layers."):
            shape = shape[1:]
        out = torch.zeros(shape)
        covered = torch.zeros(shape, dtype=torch.bool)
        for d, placed in enumerate(self.placed):
            for unit, (b, at, n) in placed.items():
                if unit[0] != name or unit[1] != layer:
                    continue
                flat = self._flat(kind, d, b)[at:at + n].view(self.units[unit][1])
                for box in unit[2]:
                    part, flat = flat[:box[1][0]], flat[box[1][0]:]
                    mask = self._box(covered, box)
                    self._box(out, box).copy_(torch.where(mask, self._box(out, box), part))
                    mask.fill_(True)
        if not bool(covered.all()):
            raise CheckpointError(f"{self.where}: the distributed optimizer holds no {kind} for "
                                  f"{'all of ' if covered.any() else ''}{name}"
                                  + (f" (layer {layer})" if layer is not None else "") + FRESH)
        return out

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
            fpath, data = stored_bytes(ck.path, info)
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
