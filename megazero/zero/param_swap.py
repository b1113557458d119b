"""ZeRO-3 parameter shards on NVMe (``--offload-param-device nvme``).

Each bucket's parameter shard (compute dtype) lives in a swap file, ``params-rank{r}.swap`` under
``--nvme-path``, and in memory only while its unit is used: :meth:`ParamSwap.fetch` gives the
bucket's *home* tensor its storage back and starts reading into it on the store's I/O threads,
:meth:`ParamSwap.ready` waits for the read, :meth:`ParamSwap.evict` resizes the storage to 0 bytes.
The home tensor keeps its identity, so the views of it that autograd saved in forward read the
right values again once the unit is fetched for its backward (as ZeRO-3's gathered buffers do,
:mod:`megazero.zero.stage3`).  :class:`~megazero.zero.stage3.Stage3Params` fetches a unit one ahead
of the schedule: the next unit in forward order during forward, the previous one during backward
(and a recomputation replay is preceded by its own pre-backward fetch).

The optimizer step overwrites every element of a bucket's shard: :meth:`materialize` (storage, no
read), the update publishes into it, :meth:`flush` writes it back and evicts it.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from megazero.offload import check_nvme_path, swap_bytes
from megazero.offload.nvme import open_store
from megazero.offload.aligned import aligned_empty, typed_view


class ParamSwap:
    """The parameter shards of ``buckets`` (dtype ``dtype``) in a swap file of this rank."""

    def __init__(self, buckets: List, dtype: torch.dtype, par, mesh):
        specs = {f"p{b.index}": (b.shard_numel, dtype) for b in buckets}
        mine = swap_bytes(specs, par.nvme_block_size)
        from megazero.zero.nvme_tier import _node_bytes
        total, ranks = _node_bytes(mine, mesh)
        what = (f"the parameter swap files of the {ranks} ranks on this node" if ranks > 1
                else "this rank's parameter swap file")
        check_nvme_path(par.nvme_path, total, what=what)
        if mesh.is_distributed:
            dist.barrier(group=mesh.world_group)
        self.store = open_store(mesh, par.nvme_path, specs, rank=mesh.rank, block_size=par.nvme_block_size,
                                io_threads=par.nvme_io_threads, check_space=False, name="params-rank")
        self.homes: Dict[int, torch.Tensor] = {}
        for b in buckets:
            home = torch.empty(b.shard_numel, dtype=dtype, device=mesh.device)
            home.untyped_storage().resize_(0)
            self.homes[b.index] = home
        self.reads: Dict[int, object] = {}  # bucket -> read in flight
        self.writes: Dict[int, object] = {}  # bucket -> write-back in flight (from a host copy)
        self.resident: set = set()
        self.peak_resident_bytes = 0  # the most shard bytes in memory at once so far

    def _alloc(self, i: int) -> torch.Tensor:
        home = self.homes[i]
        if i not in self.resident:
            home.untyped_storage().resize_(home.numel() * home.element_size())
            self.resident.add(i)
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())
        return home

    def _staging(self, i: int) -> torch.Tensor:
        """An aligned (pinned on CUDA) host copy for direct I/O: the home itself never goes to the I/O
        threads (numpy views of it would make its storage impossible to resize)."""
        home = self.homes[i]
        raw = aligned_empty(home.numel() * home.element_size(), pin=self.store.pin)
        return typed_view(raw, 0, home.numel(), home.dtype)

    def fetch(self, i: int, home: bool = True) -> torch.Tensor:
        """Bucket ``i``'s home tensor, its values being read (see :meth:`ready`) unless resident;
        ``home=False`` reads into the aligned copy only, which :meth:`take` hands over (the shard
        feeds a ZeRO-3 all-gather and is not kept)."""
        if i not in self.resident and i not in self.reads:
            staging = self._staging(i)
            self.reads[i] = (self.store.read_async(f"p{i}", staging), staging)
            if home:
                self._alloc(i)
        return self.homes[i]

    def ready(self, i: int) -> None:
        """Wait for bucket ``i``'s read and copy it into the home (if it was given one)."""
        self.take(i)

    def take(self, i: int) -> torch.Tensor:
        """Wait for bucket ``i``'s read; the shard: the aligned copy read into (copied into the home
        too when it has one), or the home when nothing was being read."""
        pending = self.reads.pop(i, None)
        if pending is None:
            return self.homes[i]
        handle, staging = pending
        handle.wait()
        if i in self.resident:
            self.homes[i].copy_(staging)
        return staging

    def evict(self, i: int) -> None:
        self.ready(i)
        if i in self.resident:
            self.homes[i].untyped_storage().resize_(0)
            self.resident.discard(i)

    def materialize(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s home with storage (contents undefined unless resident) to overwrite whole."""
        self.ready(i)
        return self._alloc(i)

    def flush(self, i: int, in_flight: int = 2) -> None:
        """Write bucket ``i``'s home back through a host copy and evict it; at most ``in_flight``
        write-backs (their copies) are pending at once."""
        self.ready(i)
        staging = self._staging(i)
        staging.copy_(self.homes[i])
        self.writes[i] = self.store.write_async(f"p{i}", staging)  # the handle keeps the copy alive
        self.evict(i)
        while len(self.writes) > in_flight:
            self.writes.pop(next(iter(self.writes))).wait()

    def settle(self) -> None:
        """Wait for the write-backs in flight."""
        for i in list(self.writes):
            self.writes.pop(i).wait()

    def resident_bytes(self) -> int:
        return sum(self.homes[i].numel() * self.homes[i].element_size() for i in self.resident)

    def close(self) -> None:
        self.settle()
        self.store.close()
