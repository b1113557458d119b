"""Loading a per-rank-shard checkpoint (format v2) into any layout, in place, in O(shard) time.

For every bucket this rank updates (its DP/ZeRO slice under the new layout) and every state key
(``master`` and the optimizer's moments), the slice is assembled from the saved shards
(:func:`megazero.checkpoint.shards.fill_range`: only the byte ranges needed, memory-mapped, each
4 MiB block checked against its CRC-32 once).  Two passes over the same mapped bytes:
:func:`verify_rank_state` checks every block and that every element is present, copying nothing;
only when every rank has passed (:func:`megazero.checkpoint.comm.agree`) does
:func:`load_rank_state` copy the values straight into the optimizer's own tensors (through one
bucket-sized staging buffer when they live on a GPU) and republish the parameters bucket by bucket.
A corrupt checkpoint therefore leaves the model untouched (``load`` can fall back to an older one),
and the extra host memory is the mapped pages of one bucket, released after each.
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.format import EMBEDDING, named_params
from megazero.checkpoint.names import param_info, split_coord, stored, stored_ranges
from megazero.checkpoint.shards import SavedShards, fill_range, full_shape


def saved_name(name: str, p) -> str:
    """The name ``p``'s state is stored under (a tied output head loads the word embeddings)."""
    return EMBEDDING if getattr(p, "tied_copy", False) else name


def check_params(meta: dict, chunks, optimizer, mesh, cfg, path: str, hint: str) -> None:
    """Every parameter of this rank is in the checkpoint with the same whole shape; else raise."""
    shapes = optimizer.param_shapes()
    suffix = f" (model settings differ: {hint})" if hint else ""
    for name, p in named_params(chunks):
        for stored_name, mine in stored(name, p, shapes.get(p, p.shape), mesh.coord("pp"), mesh):
            key = saved_name(stored_name, p)
            label = stored_name if key == stored_name else f"{stored_name} (tied to {key})"
            saved = meta["params"].get(key)
            if saved is None:
                raise CheckpointError(f"{path}: parameter {label} is not in the checkpoint{suffix}")
            have = full_shape(saved, meta["layout"]["tp"], meta["model"]["vocab_size"])
            want = full_shape(mine, mesh.size("tp"), cfg.model.vocab_size)
            if have != want or saved["split"] != mine["split"] or \
                    (mine["split"] and saved["dim"] != mine["dim"]):
                raise CheckpointError(f"{path}: parameter {label} has shape {have} in the checkpoint but "
                                      f"{want} in this model{suffix}")
    if hint:  # every parameter fit, yet the model differs (e.g. fewer layers): refuse a partial load
        raise CheckpointError(f"{path}: the checkpoint's model differs from this run's: {hint}")


def _sink(n: int) -> np.ndarray:
    """A writable stand-in for ``n`` float32 values that stores nothing (for the verifying pass)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype=np.float32), shape=(n,), strides=(0,))


def _fill_bucket(src: SavedShards, b, names, shapes, mesh, keys: List[str], lo: int, hi: int, dest) -> None:
    """``dest[k]`` (numpy, ``hi - lo`` values) = this rank's slice ``[lo, hi)`` of bucket ``b`` for
    each state key ``k``; the bucket's trailing padding is zeroed."""
    starts = {id(p): s for p, s in zip(b.params, b.starts)}
    covered = lo
    for p, a, e in b.segments(lo, hi):
        s, coord = starts[id(p)], split_coord(p, mesh)
        layouts = dict(stored(names[id(p)], p, shapes[p], mesh.coord("pp"), mesh))
        for name, plo, phi, at in stored_ranges(names[id(p)], p, shapes[p], a - s, e - s, mesh):
            for k in keys:
                fill_range(src, saved_name(name, p), k, layouts[name], coord, plo,
                           dest[k][a - lo + at:a - lo + at + phi - plo])
        covered = max(covered, e)
    for k in keys:
        dest[k][covered - lo:] = 0.0


def _frozen(chunks, shapes):
    return [(name, p) for name, p in named_params(chunks) if p not in shapes]


def verify_rank_state(src: SavedShards, chunks, optimizer, mesh, keys: List[str]) -> None:
    """Check every byte this rank will load (block checksums, every element present); copy nothing."""
    names = {id(p): n for n, p in named_params(chunks)}
    shapes = optimizer.param_shapes()
    src.verify_only = True
    try:
        for b in optimizer.buckets:
            lo, hi = optimizer.storage.updated_range(b)
            _fill_bucket(src, b, names, shapes, mesh, keys, lo, hi, {k: _sink(hi - lo) for k in keys})
            src.release()  # the mapped pages of this bucket leave this process's memory
        for name, p in _frozen(chunks, shapes):
            info = param_info(p, p.shape, mesh.coord("pp"))
            fill_range(src, saved_name(name, p), "master", info, mesh.coord("tp"), 0, _sink(p.numel()))
    finally:
        src.verify_only = False


def _host_view(t: torch.Tensor):
    """``(numpy view to fill, tensor to copy it into afterwards or None)`` for an optimizer tensor."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        return t.detach().numpy(), None
    return np.empty(t.numel(), dtype=np.float32), t


def load_rank_state(src: SavedShards, chunks, optimizer, mesh, keys: List[str]) -> None:
    """Copy this rank's slice into the optimizer in place and republish the parameters (collective
    over DP, bucket by bucket).  Call after :func:`verify_rank_state` passed on every rank."""
    names = {id(p): n for n, p in named_params(chunks)}
    shapes = optimizer.param_shapes()
    update = optimizer.update
    for b in optimizer.buckets:
        lo = optimizer.storage.updated_range(b)[0]
        optimizer.storage.begin_update(b)  # ZeRO-3 parameters on NVMe: the shard is rewritten whole
        for j, (a, e) in enumerate(update.pieces(b)):  # the whole slice in memory; sub-groups on NVMe
            tensors = update.piece_tensors(b, j, keys, read=False)
            views = {k: _host_view(tensors[k]) for k in keys}
            with torch.no_grad():
                _fill_bucket(src, b, names, shapes, mesh, keys, lo + a, lo + e,
                             {k: v[0] for k, v in views.items()})
                for staged, device_tensor in views.values():
                    if device_tensor is not None:
                        device_tensor.copy_(torch.from_numpy(staged).view(device_tensor.shape))
                update.commit_piece(b, j, tensors)
            src.release()
        optimizer.publish_params(b)
        optimizer.storage.end_update(b)
    with torch.no_grad():
        for name, p in _frozen(chunks, shapes):
            values = np.empty(p.numel(), dtype=np.float32)
            info = param_info(p, p.shape, mesh.coord("pp"))
            fill_range(src, saved_name(name, p), "master", info, mesh.coord("tp"), 0, values)
            p.copy_(torch.from_numpy(values).view(p.shape))
