"""megatron-core's torch_dist tensors from a megazero checkpoint, written by every rank of a job at once.

Each tensor megatron-core stacks over layers (``decoder.layers.self_attention.linear_qkv.weight
[L, 3h, h]``) is written as ``L`` chunks, one a layer, at offset ``(i, 0, ...)``; the others (the
embedding, padded to the padded vocabulary, the final norm, an untied head) whole.  The chunks are
shared among the ranks by size (largest first, to the least-loaded rank; the same answer on every
rank), and each rank reads a chunk from the megazero checkpoint only when
``torch.distributed.checkpoint`` writes it (:class:`PiecePlanner`), so a rank holds one layer's tensor
at a time and writes its own ``__<rank>_0.distcp``; the coordinator writes ``.metadata`` (and the
per-layer ``_extra_state`` objects, ``None`` as megatron-core's local layers keep them).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.mapping import GATED, GLOBAL, LAYER

EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
SAVED_NAME = {"input_norm": "self_attention.linear_qkv.layer_norm_{}",  # megatron-core's sharded names
              "post_attention_norm": "mlp.linear_fc1.layer_norm_{}"}


@dataclass(frozen=True)
class Piece:
    """One chunk of a megatron-core tensor: ``sources`` (megazero names, joined along their first
    dimension), then ``pad`` zero rows; stacked tensors take it as entry ``offset[0]``."""
    fqn: str
    offset: Tuple[int, ...]
    size: Tuple[int, ...]
    whole: Tuple[int, ...]
    sources: Tuple[str, ...]
    pad: int = 0
    stacked: bool = False
    key: str = "master"  # what of the megazero parameter: its master weight or an optimizer moment

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n


def _layer_target(rest: str, model: dict, prefix: str, name: str) -> Optional[Tuple[str, Tuple[str, ...]]]:
    leaf, kind = rest.rsplit(".", 1)
    if leaf == "mlp.gate":
        return None  # joined into linear_fc1
    if leaf == "mlp.fc1":
        gated = model["activation"] in GATED
        return f"mlp.linear_fc1.{kind}", ((f"{prefix}mlp.gate.{kind}",) if gated else ()) + (name,)
    if leaf in SAVED_NAME:
        return SAVED_NAME[leaf].format(kind), (name,)
    if leaf in LAYER:
        return LAYER[leaf][0].format(kind), (name,)
    raise CheckpointError(f"--ckpt-format torch_dist: {name} has no megatron-core name here")


def optimizer_kinds(meta: dict, config: dict) -> List[Tuple[str, str]]:
    """``(megatron-core's state name, megazero's key)`` of the optimizer state written with the weights:
    Adam's moments (and, with bf16 weights, the fp32 main weights as ``fp32_param``), as megatron-core's
    non-distributed optimizer saves them; none for another optimizer or fp16 (its loss scaler)."""
    opt = meta.get("optimizer") or {}
    precision = config.get("precision", {})
    if opt.get("name") != "adam" or "exp_avg" not in (opt.get("state_names") or []) or precision.get("fp16"):
        return []
    kinds = [("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")]
    return kinds + ([("fp32_param", "master")] if precision.get("bf16") else [])


def pieces(shapes: Dict[str, Tuple[int, ...]], model: dict, kinds=()) -> List[Piece]:
    """The chunks of megatron-core's tensors for megazero parameters of whole (unpadded) ``shapes``, and
    of the optimizer state ``kinds`` (:func:`optimizer_kinds`) under megatron-core's names
    (``optimizer.state.<kind>.<weight's name>``, chunked as the weight)."""
    layers, padded = model["num_layers"], model["padded_vocab_size"]
    if model["untie_embeddings_and_output_weights"] and "output_layer.weight" not in shapes:
        raise CheckpointError("the checkpoint has no output_layer.weight for an untied head")
    out: List[Piece] = []
    for name, fqn in GLOBAL.items():
        if name in shapes:
            shape = tuple(shapes[name])
            pad = padded - shape[0] if name in ("word_embeddings.weight", "output_layer.weight") else 0
            whole = (shape[0] + max(pad, 0),) + shape[1:]
            out.append(Piece(fqn, (0,) * len(shape), whole, whole, (name,), max(pad, 0)))
    for i in range(layers):
        prefix = f"decoder.{i}."
        for name in sorted(n for n in shapes if n.startswith(prefix)):
            target = _layer_target(name[len(prefix):], model, prefix, name)
            if target is None:
                continue
            leaf, sources = target
            rows = sum(shapes[s][0] for s in sources)
            size = (1, rows) + tuple(shapes[name][1:])
            out.append(Piece("decoder.layers." + leaf, (i,) + (0,) * (len(size) - 1), size,
                             (layers,) + size[1:], sources, stacked=True))
    states = [replace(p, fqn=f"optimizer.state.{kind}.{p.fqn}", key=key) for kind, key in kinds for p in out]
    return out + states


def assign(all_pieces: List[Piece], ranks: int) -> List[List[Piece]]:
    """The pieces of each rank: largest first, each to the least-loaded rank (ties: the lowest)."""
    load = [0] * ranks
    out: List[List[Piece]] = [[] for _ in range(ranks)]
    for p in sorted(all_pieces, key=lambda p: (-p.numel, p.fqn, p.offset)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        out[r].append(p)
        load[r] += p.numel
    return out


def extra_state_objects(model: dict) -> Dict[str, object]:
    """megatron-core's per-layer extra state objects: a one-item list holding ``None``."""
    n = model["num_layers"]
    return {f"decoder.layers.{leaf}._extra_state/shard_{i}_{n}": [None]
            for leaf in EXTRA_STATE for i in range(n)}


def _planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class PiecePlanner(DefaultSavePlanner):
        """A save plan of this rank's :class:`Piece` chunks (and the objects, on the coordinator),
        each read by ``get(name)`` when it is written."""

        def __init__(self, mine: List[Piece], objects: Dict[str, object],
                     get: Callable[[str, str], torch.Tensor]):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.mine = {(p.fqn, p.offset): p for p in mine}
            self.objects, self.get = objects, get

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> SavePlan:
            items = []
            for p in self.mine.values():
                chunk = ChunkStorageMetadata(offsets=torch.Size(p.offset), sizes=torch.Size(p.size))
                data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32),
                                       size=torch.Size(p.whole))
                items.append(WriteItem(index=MetadataIndex(p.fqn, torch.Size(p.offset)),
                                       type=WriteItemType.SHARD, tensor_data=data))
            if self.is_coordinator:
                items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.objects]
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            if index.offset is None:
                return self.objects[index.fqn]
            p = self.mine[(index.fqn, tuple(index.offset))]
            parts = [self.get(s, p.key) for s in p.sources]
            t = torch.cat(parts) if len(parts) > 1 else parts[0]
            if p.pad:
                t = torch.cat([t, t.new_zeros(p.pad, *t.shape[1:])])
            return (t.unsqueeze(0) if p.stacked else t).contiguous()
    return PiecePlanner


def read_full(src, name: str, key: str, vocab: int) -> torch.Tensor:
    """Parameter ``name``'s whole fp32 ``key`` (master or a moment) from megazero's saved shards ``src``
    (a :class:`~megazero.checkpoint.shards.SavedShards`): its TP pieces joined, the vocabulary unpadded."""
    import numpy as np
    from megazero.checkpoint.reader import _read_full_streaming
    from megazero.checkpoint.shards import full_shape
    if key == "master":
        return _read_full_streaming(src, name, vocab)
    info, tp = src.params[name], src.parts(name)
    shape = list(full_shape(info, tp, vocab if info["vocab_parallel"] else None))
    local = [int(x) for x in info["shape"]]
    dim = info["dim"] if info["split"] else 0
    out = torch.empty(shape, dtype=torch.float32)
    for t in range(tp):
        take = max(0, min(local[dim], shape[dim] - t * local[dim]))  # the padded vocabulary's tail: none
        if take:
            piece = np.empty(int(np.prod(local, dtype=np.int64)), dtype=np.float32)
            src.read(t, name, key, 0, piece)
            src.release()
            whole = torch.from_numpy(piece).view(local)
            out.narrow(dim, t * local[dim], take).copy_(whole.narrow(dim, 0, take))
    return out


def write_tensors(src: str, iteration: Optional[int], out: str, rank: int = 0, ranks: int = 1,
                  group=None) -> Tuple[dict, dict]:
    """Write megatron-core's tensors of megazero checkpoint ``src`` (its ``iteration``, else its latest)
    into directory ``out`` (which must exist): collective over ``group`` (``ranks`` ranks, this one
    ``rank``), or one process when ``group`` is None.  Returns the checkpoint's ``(metadata, config)``."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from megazero.checkpoint.format import CONFIG
    from megazero.checkpoint.integrity import read_json
    from megazero.checkpoint.resolve import resolve_here
    from megazero.checkpoint.shards import SavedShards, full_shape
    path, meta, _ = resolve_here(src, iteration, flag="--input")
    config = read_json(os.path.join(path, CONFIG))
    vocab = meta["model"]["vocab_size"]
    shards = SavedShards(path, meta)
    try:
        shapes = {n: full_shape(info, shards.parts(n), vocab if info["vocab_parallel"] else None)
                  for n, info in meta["params"].items()}
        mine = assign(pieces(shapes, config["model"], optimizer_kinds(meta, config)), ranks)[rank]
        objects = extra_state_objects(config["model"]) if rank == 0 else {}
        planner = _planner_class()(mine, objects, lambda name, key: read_full(shards, name, key, vocab))
        with warnings.catch_warnings():  # one process: DCP's note that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            save({}, storage_writer=FileSystemWriter(out), planner=planner, process_group=group,
                 no_dist=group is None)
    finally:
        shards.close()
    return meta, config
