"""Loading a per-rank-shard checkpoint (format v2) into any layout, in O(shard) memory.

For every bucket this rank updates (its DP/ZeRO slice under the new layout) and every state key
(``master`` and the optimizer's moments), :func:`read_rank_state` fills a float32 buffer of the
slice's size from the saved shards (:func:`megazero.checkpoint.shards.fill_range`: only the byte
ranges needed, memory-mapped, checksummed block by block).  Nothing is committed until every rank
has read and verified all its data (:func:`megazero.checkpoint.format.agree`), so a corrupt
checkpoint leaves the model untouched and ``load`` can fall back to an older one; then
:func:`commit` copies the buffers into the optimizer and republishes the parameters.  Peak extra
host memory: this rank's slice of the optimizer state, plus the mapped pages of one bucket.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megazero.checkpoint.format import EMBEDDING, CheckpointError, named_params
from megazero.checkpoint.shards import SavedShards, fill_range, full_shape, param_info


def saved_name(name: str, p) -> str:
    """The name ``p``'s state is stored under (a tied output head loads the word embeddings)."""
    return EMBEDDING if getattr(p, "tied_copy", False) else name


def check_params(meta: dict, chunks, optimizer, mesh, cfg, path: str, hint: str) -> None:
    """Every parameter of this rank is in the checkpoint with the same whole shape; else raise."""
    shapes = optimizer.param_shapes()
    suffix = f" (model settings differ: {hint})" if hint else ""
    for name, p in named_params(chunks):
        key = saved_name(name, p)
        label = name if key == name else f"{name} (tied to {key})"
        saved = meta["params"].get(key)
        if saved is None:
            raise CheckpointError(f"{path}: parameter {label} is not in the checkpoint{suffix}")
        mine = param_info(p, shapes.get(p, p.shape), mesh.pp_rank)
        have = full_shape(saved, meta["layout"]["tp"], meta["model"]["vocab_size"])
        want = full_shape(mine, mesh.tp_size, cfg.model.vocab_size)
        if have != want or saved["split"] != mine["split"] or (mine["split"] and saved["dim"] != mine["dim"]):
            raise CheckpointError(f"{path}: parameter {label} has shape {have} in the checkpoint but {want} "
                                  f"in this model{suffix}")
    if hint:  # every parameter fit, yet the model differs (e.g. fewer layers): refuse a partial load
        raise CheckpointError(f"{path}: the checkpoint's model differs from this run's: {hint}")


def read_rank_state(src: SavedShards, chunks, optimizer, mesh, keys: List[str]) -> Tuple[dict, list]:
    """``({bucket index: {key: values of this rank's slice}}, [(frozen param, values)])``."""
    names = {id(p): n for n, p in named_params(chunks)}
    shapes = optimizer.param_shapes()
    data: Dict[int, Dict[str, torch.Tensor]] = {}
    for b in optimizer.buckets:
        lo, hi = optimizer.storage.updated_range(b)
        starts = {id(p): s for p, s in zip(b.params, b.starts)}
        out = {k: torch.zeros(hi - lo, dtype=torch.float32) for k in keys}
        for p, a, e in b.segments(lo, hi):
            new = param_info(p, shapes[p], mesh.pp_rank)
            name, s = saved_name(names[id(p)], p), starts[id(p)]
            for k in keys:
                fill_range(src, name, k, new, mesh.tp_rank, a - s, e - s, out[k][a - lo:e - lo])
        data[b.index] = out
        src.release()  # the mapped pages of this bucket leave this process's memory
    frozen = []
    for name, p in named_params(chunks):
        if p not in shapes:
            new = param_info(p, p.shape, mesh.pp_rank)
            values = torch.empty(p.numel(), dtype=torch.float32)
            fill_range(src, saved_name(name, p), "master", new, mesh.tp_rank, 0, p.numel(), values)
            frozen.append((p, values.view(p.shape)))
    return data, frozen


def commit(optimizer, data: Dict[int, Dict[str, torch.Tensor]], frozen) -> None:
    """Copy the read state into the optimizer; the compute-dtype parameters follow (collective over DP)."""
    update = optimizer.update
    for b in optimizer.buckets:
        values = data[b.index]
        update.master[b.index].copy_(values["master"])
        for k, t in update.state[b.index].items():
            t.copy_(values[k])
        optimizer.publish_params(b)
    with torch.no_grad():
        for p, t in frozen:
            p.copy_(t)
