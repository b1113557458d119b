"""Finding a Megatron-LM checkpoint on disk and reading its tensors whole.

Megatron-LM's layout (both formats)::

    DIR/latest_checkpointed_iteration.txt     "500" (or "release")
    DIR/iter_0000500/                          torch_dist: .metadata, __<r>_<i>.distcp, common.pt,
                                               metadata.json ({"sharded_backend": "torch_dist", ...})
    DIR/iter_0000500/mp_rank_00[_000]/model_optim_rng.pt      legacy (--ckpt-format torch): one file
                                               per tensor-parallel rank (and pipeline stage: _PPP)

:class:`MegatronCheckpoint` reads the stored arguments and trainer state, and every tensor of the
model whole (a torch_dist tensor from the shards that cover it; a legacy one joined over TP ranks and
pipeline stages), one at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError
from megazero.checkpoint.megatron.safe_load import load_dcp_metadata, load_pt

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_DIR = re.compile(r"mp_rank_(\d\d)(?:_(\d\d\d))?$")
# legacy: the dimension tensor parallelism splits, by the end of the name (others are replicated)
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          "word_embeddings.weight", "output_layer.weight", "linear_q.weight", "linear_kv.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def iteration_dir(directory: str, iteration: Optional[int] = None) -> Tuple[str, int]:
    """``(path, iteration)`` of the checkpoint to read: ``iteration`` or the tracker's."""
    if iteration is None:
        tracker = os.path.join(directory, TRACKER)
        try:
            text = open(tracker).read().strip()
        except OSError:
            raise CheckpointError(f"--load {directory}: {TRACKER} is missing; name the iteration with "
                                  "--ckpt-step") from None
        if text == "release":
            return os.path.join(directory, "release"), 0
        if not text.isdigit():
            raise CheckpointError(f"--load {directory}: {TRACKER} holds {text[:40]!r}, not an iteration")
        iteration = int(text)
    path = os.path.join(directory, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {directory}: {path} is missing (the iteration "
                              f"{TRACKER} or --ckpt-step names)")
    return path, iteration


def format_of(path: str) -> Optional[str]:
    """``"torch_dist"``, ``"torch"`` (legacy) or None (not Megatron-LM's: megazero's ``metadata.json``
    alone is not) for an ``iter_*`` directory."""
    names = os.listdir(path) if os.path.isdir(path) else []
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "torch_dist"
    if any(LEGACY_DIR.match(n) for n in names):
        return "torch"
    return None


class MegatronCheckpoint:
    """One iteration's checkpoint: :attr:`args` (Megatron's stored namespace, or None),
    :attr:`state` (the non-tensor items: iteration, opt_param_scheduler, ...), :meth:`names` and
    :meth:`tensor` (whole, float32)."""

    def __init__(self, directory: str, iteration: Optional[int] = None, ckpt_format: Optional[str] = None):
        self.directory = directory
        self.path, self.iteration = iteration_dir(directory, iteration)
        found = format_of(self.path)
        if found is None:
            raise CheckpointError(f"--load {directory}: {self.path} holds neither a torch_dist checkpoint "
                                  "nor mp_rank_* directories")
        if ckpt_format not in (None, found):
            raise CheckpointError(f"--ckpt-format {ckpt_format}: {self.path} is a {found} checkpoint; pass "
                                  f"--ckpt-format {found}")
        self.format = found
        self._legacy: Dict[Tuple[int, int], dict] = {}
        if found == "torch_dist":
            self._open_dist()
        else:
            self._open_legacy()
        args = self.state.get("args")
        self.args = args if args is not None and hasattr(args, "__dict__") else None

    # ---- torch_dist ---------------------------------------------------------------------------
    def _open_dist(self) -> None:
        meta_json = os.path.join(self.path, "metadata.json")
        if os.path.isfile(meta_json):
            try:
                backend = json.load(open(meta_json)).get("sharded_backend")
            except ValueError:
                raise CheckpointCorrupt(f"{meta_json}: not valid JSON") from None
            if backend not in (None, "torch_dist"):
                raise CheckpointError(f"{self.path}: sharded backend {backend!r}; only torch_dist is read")
        self.meta = load_dcp_metadata(os.path.join(self.path, ".metadata"))
        self._check_files()
        common = os.path.join(self.path, "common.pt")
        self.state = load_pt(common) if os.path.isfile(common) else {}
        self.shapes = {k: tuple(v.size) for k, v in self.meta.state_dict_metadata.items()
                       if hasattr(v, "size") and hasattr(v, "chunks")}

    def _check_files(self) -> None:
        """Every shard file the index names is there and long enough for what it points into."""
        need: Dict[str, int] = {}
        for info in self.meta.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(need.items()):
            fpath = os.path.join(self.path, name)
            if not os.path.isfile(fpath):
                raise CheckpointCorrupt(f"{fpath} is missing (the checkpoint's .metadata names it)")
            if os.path.getsize(fpath) < end:
                raise CheckpointCorrupt(f"{fpath} is truncated: {os.path.getsize(fpath)} bytes, the index "
                                        f"needs {end}")

    def _dist_slice(self, name: str, first: Optional[int]) -> torch.Tensor:
        """``name`` whole, or only its entry ``first`` along the leading (layer) axis: each stored chunk
        that covers it is read from its shard file (``torch.load(weights_only=True)`` of the chunk's
        bytes) and copied into place, so a layer costs the memory of a layer."""
        props = self.meta.state_dict_metadata[name]
        size = list(props.size)
        box = (first, first + 1) if first is not None else (0, size[0] if size else 1)
        out = torch.empty([box[1] - box[0]] + size[1:] if size else [], dtype=props.properties.dtype)
        chunks = {tuple(c.offsets): tuple(c.sizes) for c in props.chunks}
        covered = 0
        for index, info in self.meta.storage_data.items():
            if index.fqn != name:
                continue
            if info.transform_descriptors:  # stored through a transform (compression): DCP's reader
                t = self._dist_tensor(name)
                return t if first is None else t[first]
            at = tuple(index.offset) if index.offset is not None else (0,) * len(size)
            sizes = chunks[at]
            if size and (at[0] >= box[1] or at[0] + sizes[0] <= box[0]):
                continue
            piece = self._read_chunk(name, info, sizes)
            if size:
                lo, hi = max(at[0], box[0]), min(at[0] + sizes[0], box[1])
                piece = piece[lo - at[0]:hi - at[0]]
                dst = out[lo - box[0]:hi - box[0]]
                for d in range(1, len(size)):
                    dst = dst.narrow(d, at[d], sizes[d])
            else:
                dst = out
            dst.copy_(piece)
            covered += piece.numel()
        if covered != out.numel():
            raise CheckpointCorrupt(f"{self.path}: the stored chunks of {name} do not cover it")
        return (out if first is None else out[0]).float()

    def _read_chunk(self, name: str, info, sizes) -> torch.Tensor:
        import io
        fpath, data = stored_bytes(self.path, info)
        try:
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - damaged bytes
            why = " ".join(str(err).split()).split(". ")[0][:160]
            raise CheckpointCorrupt(f"{fpath}: the bytes of {name} are damaged ({why})") from None
        if not torch.is_tensor(t) or tuple(t.shape) != tuple(sizes):
            raise CheckpointCorrupt(f"{fpath}: {name}'s chunk is not a tensor of shape {tuple(sizes)}")
        return t

    def _dist_tensor(self, name: str) -> torch.Tensor:
        from torch.distributed.checkpoint import FileSystemReader, load
        meta = self.meta

        class Reader(FileSystemReader):  # the allow-listed metadata, not a pickle.load
            def read_metadata(self, *args, **kwargs):
                meta.storage_meta = getattr(meta, "storage_meta", None)
                return meta
        props = self.meta.state_dict_metadata[name]
        out = {name: torch.empty(props.size, dtype=props.properties.dtype)}
        try:
            load(out, storage_reader=Reader(self.path), no_dist=True)
        except Exception as err:  # noqa: BLE001 - damaged shard contents
            why = " ".join(str(err).split())[:200]
            raise CheckpointCorrupt(f"{self.path}: reading {name} failed ({why})") from None
        return out[name].float()

    # ---- legacy -------------------------------------------------------------------------------
    def _open_legacy(self) -> None:
        ranks = {}
        for n in os.listdir(self.path):
            m = LEGACY_DIR.match(n)
            if m:
                key = (int(m.group(1)), int(m.group(2) or 0))
                ranks[key] = os.path.join(self.path, n, "model_optim_rng.pt")
        if not ranks:
            raise CheckpointError(f"{self.path}: no mp_rank_* directory")
        tp = 1 + max(t for t, _ in ranks)
        pp = 1 + max(p for _, p in ranks)
        self._files = ranks
        if (0, 0) in ranks and os.path.isfile(ranks[(0, 0)]):  # the saving sizes, as its args say them
            args = vars(self._rank(0, 0).get("args") or argparse.Namespace())
            tp = max(tp, int(args.get("tensor_model_parallel_size") or 1))
            pp = max(pp, int(args.get("pipeline_model_parallel_size") or 1))
        for t in range(tp):
            for p in range(pp):
                if (t, p) not in ranks:
                    stem = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                    raise CheckpointCorrupt(f"{self.path}: {stem} is missing (tensor-parallel rank {t}, "
                                            f"pipeline stage {p} of a TP {tp} x PP {pp} checkpoint)")
                if not os.path.isfile(ranks[(t, p)]):
                    raise CheckpointCorrupt(f"{ranks[(t, p)]} is missing")
        self.tp, self.pp = tp, pp
        first = self._rank(0, 0)
        self.state = {k: v for k, v in first.items() if k not in ("model", "optimizer", "rng_state")}
        self._layer_names: Dict[str, List[Tuple[int, str]]] = {}
        offset = 0
        self.shapes = {}
        for p in range(pp):
            model = self._rank(0, p)["model"]
            layers = set()
            for k, v in model.items():
                if not torch.is_tensor(v) or k.endswith("_extra_state"):
                    continue
                m = re.match(r"decoder\.layers\.(\d+)\.(.*)", k)
                if m:
                    layers.add(int(m.group(1)))
                    key = f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}"
                else:
                    key = k
                self._layer_names.setdefault(key, []).append((p, k))
            offset += len(layers)
        self.num_layers = offset

    def _rank(self, t: int, p: int) -> dict:
        if (t, p) not in self._legacy:
            if len(self._legacy) >= max(2, getattr(self, "tp", 1)):  # a stage's files open (memory-mapped)
                self._legacy.pop(next(iter(self._legacy)))
            state = load_pt(self._files[(t, p)])
            if not isinstance(state, dict) or "model" not in state:
                raise CheckpointError(f"{self._files[(t, p)]}: no 'model' entry; not a Megatron-LM "
                                      "checkpoint")
            self._legacy[(t, p)] = state
        return self._legacy[(t, p)]

    def _legacy_tensor(self, name: str, glu: bool, fetch=None) -> torch.Tensor:
        p, key = self._layer_names[name][0]
        parts = []
        for t in range(self.tp):
            model = self._rank(t, p)["model"]
            if key not in model:
                raise CheckpointCorrupt(f"{self._files[(t, p)]}: {key} is missing")
            parts.append(model[key].float() if fetch is None else fetch(t, p, key))
        if self.tp == 1 or not name.endswith(COLUMN + ROW):
            return parts[0]
        if name.endswith(ROW):
            return torch.cat(parts, dim=1)
        if glu and "linear_fc1" in name:  # each rank holds [gate_r; up_r]
            halves = [x.chunk(2, dim=0) for x in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(parts, dim=0)

    # ---- both ---------------------------------------------------------------------------------
    def names(self) -> List[str]:
        """Tensor names, Megatron-core's (``decoder.layers.<i>.…`` for legacy, ``decoder.layers.…``
        stacked over layers for torch_dist)."""
        return sorted(self._layer_names) if self.format == "torch" else sorted(self.shapes)

    def has(self, name: str) -> bool:
        return name in (self._layer_names if self.format == "torch" else self.shapes)

    def tensor(self, name: str, glu: bool = False, layer: Optional[int] = None, fetch=None) -> torch.Tensor:
        """Tensor ``name`` whole, float32 (torch_dist: stacked over layers where Megatron stacks it, or
        only entry ``layer`` of the stack).  Legacy: ``fetch(tp, pp, key)`` gives each rank's piece
        instead of the weight (the optimizer's state of it: :mod:`~.optim_state`)."""
        if self.format == "torch":
            return self._legacy_tensor(name, glu, fetch)
        return self._dist_slice(name, layer)


def trainer_extra(ck: "MegatronCheckpoint") -> dict:
    """The ``extra`` a megazero checkpoint records, from Megatron-LM's stored state."""
    extra = {"converted_from": os.path.abspath(ck.path), "megatron_format": ck.format}
    args = vars(ck.args) if ck.args is not None else {}
    if args.get("consumed_train_samples") is not None:
        extra["consumed_samples"] = int(args["consumed_train_samples"])
    sched = ck.state.get("opt_param_scheduler") or {}
    if isinstance(sched, dict) and sched.get("num_steps") is not None:
        extra["lr_samples"] = int(sched["num_steps"])
    if args.get("skipped_train_samples"):
        extra["skipped_samples"] = int(args["skipped_train_samples"])
    return extra


def stored_bytes(directory: str, info) -> Tuple[str, bytes]:
    """The file and the bytes of one item of a torch_dist checkpoint in ``directory`` (``info``: its
    storage record in the metadata: relative path, offset, length)."""
    fpath = os.path.join(directory, info.relative_path)
    with open(fpath, "rb") as fh:
        fh.seek(info.offset)
        return fpath, fh.read(info.length)
