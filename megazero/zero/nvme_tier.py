"""The optimizer state of the buckets that live on NVMe (``--offload-optimizer-device nvme``).

Each such bucket's updated range is cut into *sub-groups* of at most ``S`` elements, ``S`` chosen so
that a sub-group's master weights and moments, packed at aligned offsets, fit one
``--nvme-buffer-size`` buffer.  Sub-group ``(b, j)`` is three (Adam) or two (SGD with momentum)
names of one :class:`~megazero.offload.NvmeStore` (``b{b}.{j}.master``, ``b{b}.{j}.exp_avg`` ...).
A step walks them with a :class:`~megazero.offload.Streamer`: while sub-group ``k`` is updated,
``k+1`` is read and ``k-1`` written back on the store's I/O threads.  The walk ends with the last
write-back still in flight and the first sub-groups of the next step being read, so that both
overlap the next forward and backward.

Checkpoints move one sub-group at a time through the streamer's first buffer (settled first):
:meth:`NvmeTier.read_group` / :meth:`NvmeTier.staging` + :meth:`NvmeTier.write_group`.
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megazero.offload.element_bytes import FP32
from megazero.offload import Streamer, check_nvme_path, swap_bytes
from megazero.offload.nvme import open_store
from megazero.offload.aligned import ALIGN


def subgroup_elements(buffer_size: int, keys: int) -> int:
    """Elements per sub-group so that ``keys`` fp32 tensors, each at a page boundary, fit ``buffer_size``."""
    per_key = (buffer_size // keys) // ALIGN * ALIGN
    return max(ALIGN // FP32, per_key // FP32)


def cut(length: int, size: int) -> List[Tuple[int, int]]:
    """``[0, length)`` in consecutive runs of at most ``size`` (one empty-free list; [] for 0)."""
    return [(a, min(a + size, length)) for a in range(0, length, size)]


class NvmeTier:
    """Sub-groups of the buckets ``lengths`` (bucket index -> updated-range length) in a swap file of
    global rank ``rank``; ``state_names``: the optimizer's moments; ``par``: the parallel settings
    (``nvme_*``).  Checks ``--nvme-path`` (room for every rank on this node) before allocating."""

    def __init__(self, lengths: Dict[int, int], state_names: Sequence[str], par, mesh):
        self.keys = ("master",) + tuple(state_names)
        size = subgroup_elements(par.nvme_buffer_size, len(self.keys))
        self.pieces: Dict[int, List[Tuple[int, int]]] = {b: cut(n, size) for b, n in lengths.items()}
        specs, self.index, groups = {}, {}, []
        for b, pieces in self.pieces.items():
            for j, (a, e) in enumerate(pieces):
                names = tuple(f"b{b}.{j}.{k}" for k in self.keys)
                specs.update({n: e - a for n in names})
                self.index[(b, j)] = len(groups)
                groups.append(names)
        mine = swap_bytes(specs, par.nvme_block_size)
        total, ranks = _node_bytes(mine, mesh)
        what = f"the swap files of the {ranks} ranks on this node" if ranks > 1 else "this rank's swap files"
        check_nvme_path(par.nvme_path, total, reclaimable=_leftover(par.nvme_path, mesh.rank), what=what)
        if mesh.is_distributed:
            dist.barrier(group=mesh.world_group)  # every rank checked the free room before any allocates
        self.store = open_store(mesh, par.nvme_path, specs, rank=mesh.rank, block_size=par.nvme_block_size,
                                io_threads=par.nvme_io_threads, check_space=False)  # locked: one run per file
        self.streamer = Streamer(self.store, groups, buffer_count=par.nvme_buffer_count)

    # ---- set-up ---------------------------------------------------------------------------
    def init_bucket(self, b: int, master: torch.Tensor) -> None:
        """Write bucket ``b``'s fp32 master values (its updated range) and zeroed moments."""
        for j, (a, e) in enumerate(self.pieces[b]):
            views = self.staging(b, j)
            views["master"].copy_(master[a:e])
            for k in self.keys[1:]:
                views[k].zero_()
            self.write_group(b, j, views)

    # ---- the step -------------------------------------------------------------------------
    def walk(self, buckets: Sequence[int]) -> Iterator[Dict[str, torch.Tensor]]:
        """Every sub-group of ``buckets`` in that order, as ``{key: tensor}`` views of a streaming
        buffer to update in place (written back when the next one is asked for)."""
        order = [self.index[(b, j)] for b in buckets for j in range(len(self.pieces[b]))]
        for k, views in self.streamer.run(order, carry=True):  # the next step's first reads start now
            yield {key: t for key, t in zip(self.keys, views.values())}

    def fence(self, event) -> None:
        self.streamer.fence(event)

    # ---- checkpoints: one sub-group at a time ---------------------------------------------
    def staging(self, b: int, j: int) -> Dict[str, torch.Tensor]:
        """Sub-group ``(b, j)``'s tensors as views of the first streaming buffer (contents undefined);
        settles the last step's write-backs and drops its reads ahead first."""
        self.streamer.drain()
        views = self.streamer.views(self.index[(b, j)], self.streamer.buffers[0])
        return {key: t for key, t in zip(self.keys, views.values())}

    def read_group(self, b: int, j: int, keys: Sequence[str] = None) -> Dict[str, torch.Tensor]:
        """Read sub-group ``(b, j)`` (``keys``: all by default) into :meth:`staging`; valid until the
        next call."""
        views = self.staging(b, j)
        keys = self.keys if keys is None else keys
        handles = [self.store.read_async(f"b{b}.{j}.{k}", views[k]) for k in keys]
        for h in handles:
            h.wait()
        return {k: views[k] for k in keys}

    def write_group(self, b: int, j: int, views: Dict[str, torch.Tensor]) -> None:
        """Write the given keys of sub-group ``(b, j)`` and wait."""
        self.streamer.drain()
        handles = [self.store.write_async(f"b{b}.{j}.{k}", t) for k, t in views.items()]
        for h in handles:
            h.wait()

    def zero_moments(self) -> None:
        for b, pieces in self.pieces.items():
            for j in range(len(pieces)):
                views = self.staging(b, j)
                for k in self.keys[1:]:
                    views[k].zero_()
                self.write_group(b, j, {k: views[k] for k in self.keys[1:]})

    # ---- accounting and lifetime ------------------------------------------------------------
    @property
    def nvme_bytes(self) -> int:
        return self.store.file_bytes

    @property
    def host_bytes(self) -> int:
        return self.streamer.host_bytes

    def close(self) -> None:
        try:
            self.streamer.drain()
        finally:
            self.store.close()


def _node_bytes(mine: int, mesh) -> Tuple[int, int]:
    """``(bytes, ranks)`` of the swap files of the ranks sharing this node's disk: every rank's when
    ``LOCAL_WORLD_SIZE`` is unset (forked test ranks), else the world's scaled to the local share."""
    if not mesh.is_distributed:
        return mine, 1
    t = mesh.collective_tensor([mine], dtype=torch.int64)
    dist.all_reduce(t, group=mesh.world_group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size))
    return -(-int(t.item()) * local // mesh.world_size), local


def _leftover(path, rank: int) -> int:
    """Bytes of a swap file a crashed run left (overwritten, so it counts as free room)."""
    f = os.path.join(str(path), f"rank{rank}.swap") if path else ""
    return os.path.getsize(f) if f and os.path.isfile(f) else 0
