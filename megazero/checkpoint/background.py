"""``--async-save``: a checkpoint written in a background thread while training goes on.

At the save iteration every rank (collectively) has global rank 0 prepare ``iter_X.tmp``, and takes
a :class:`Snapshot` of this rank's state in host memory, which takes the place of the optimizer for
the writer: the generator states, the optimizer's counters and loss-scaler state at once, and, in a
daemon thread, the fp32 master weights and optimizer moments of every bucket it updates.  That
copy overlaps the next forward and backward; the next optimizer update of a bucket waits until the
bucket is copied.  The same thread then writes the same shard, index and RNG files a synchronous
save writes, from the snapshot, with no collective.
:meth:`AsyncSave.finish` (main thread, collective: the next save, the confirmation of the pending
one, the end of the run) joins the thread, agrees on errors and has rank 0 write ``config.json`` and
the sealed ``metadata.json``; publication follows as for any save
(:func:`megazero.checkpoint.publish`).
The bytes equal a synchronous save of the same iteration, and until publication the previous
checkpoint and the tracker are untouched: a crash during the write leaves an ``iter_X.tmp`` that is
never loaded.  Memory: one host copy of this rank's optimizer state, kept between saves (reused: no
new pages).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from types import SimpleNamespace
from typing import Optional

import torch

from megazero.checkpoint.comm import agree, all_ok
from megazero.checkpoint.errors import CheckpointError, CheckpointSaveError
from megazero.checkpoint.format import (CONFIG, checkpoint_path, named_params, rng_file,
                                        saved_settings)
from megazero.checkpoint.integrity import describe_file, write_json


def _host_like(t: torch.Tensor, into: Optional[torch.Tensor]) -> torch.Tensor:
    """A host tensor to copy ``t`` into: ``into`` when it fits (the previous save's, no new pages), else
    a new one (pinned when ``t`` lives on a GPU, so the copy is a fast DMA)."""
    if into is None or into.shape != t.shape or into.dtype != t.dtype:
        into = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    return into


class _SnapshotUpdate:
    """The copied optimizer state, read the way the shard writer reads a live update: one piece per
    bucket, the whole updated range (a snapshot holds every bucket in memory; ``--async-save`` is
    refused with the optimizer state on NVMe)."""

    def __init__(self, master, state, storage, names):
        self.master, self.state, self._storage, self._names = master, state, storage, list(names)

    def state_names(self, with_master: bool = False):
        return (["master"] if with_master else []) + self._names

    def pieces(self, b):
        lo, hi = self._storage.updated_range(b)
        return [(0, hi - lo)]

    def piece_tensors(self, b, j, keys=None):
        live = {"master": self.master[b.index], **self.state[b.index]}
        return {k: live[k] for k in (keys if keys is not None else live)}


class Snapshot:
    """The parts of a :class:`~megazero.zero.ZeroOptimizer` that writing a checkpoint reads, in host
    memory (the layout objects, which never change, are shared).  The counters and the loss scaler
    are copied at once; the master weights and moments by :meth:`copy` (the writer thread, bucket
    by bucket), each bucket before the optimizer may update it again: the snapshot holds the
    optimizer back (:meth:`~megazero.zero.update.ShardedUpdate.hold`) until that bucket is copied."""

    def __init__(self, optimizer, host=None):
        self.buckets, self.storage = optimizer.buckets, optimizer.storage
        self._shapes = optimizer.param_shapes()
        upd = optimizer.update
        master, state = host if host is not None else ({}, {})  # the previous save's buffers, reused
        self.update = _SnapshotUpdate(
            {i: _host_like(t, master.get(i)) for i, t in upd.master.items()},
            {i: {k: _host_like(t, state.get(i, {}).get(k)) for k, t in s.items()}
             for i, s in upd.state.items()},
            optimizer.storage, upd.state_names())
        self.state = self.update.state
        self._sources = [(i, upd.master.get(i), upd.state.get(i, {}))
                         for i in sorted(set(upd.master) | set(upd.state))]
        self.copied = {i: threading.Event() for i, _, _ in self._sources}
        upd.hold(self.copied)
        self.step_count, self.skipped_steps = int(optimizer.step_count), int(optimizer.skipped_steps)
        scaler = dict(optimizer.scaler.state_dict())
        self.scaler = SimpleNamespace(state_dict=lambda: dict(scaler))

    def copy(self) -> None:
        """Copy every bucket's masters and moments into the host buffers, releasing each bucket to the
        optimizer once it is copied (all of them, even after an error)."""
        try:
            for i, master, state in self._sources:
                if master is not None:
                    self.update.master[i].copy_(master.detach())
                for k, t in state.items():
                    self.update.state[i][k].copy_(t.detach())
                self.copied[i].set()
        finally:
            for done in self.copied.values():
                done.set()
            self._sources = []

    def param_shapes(self):
        return self._shapes


class AsyncSave:
    """One checkpoint being written in the background (see the module)."""

    def __init__(self, directory: str, iteration: int, chunks, optimizer, mesh, cfg, extra, lock,
                 host=None):
        from megazero.checkpoint.writer import _prepare, _rng_payload
        start = time.perf_counter()
        self.directory, self.iteration, self.mesh, self.cfg = directory, iteration, mesh, cfg
        self.extra, self.lock = dict(extra or {}), lock
        self.final = checkpoint_path(directory, iteration)
        self.tmp = self.final + ".tmp"
        _prepare(directory, self.tmp, mesh)
        self.snapshot = Snapshot(optimizer, host)
        self.named = named_params(chunks)
        rng = _rng_payload(chunks, mesh)
        self.snapshot_seconds = time.perf_counter() - start
        self.result, self.error = ({}, {}), None
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._write, args=(rng,), name="megazero-async-save",
                                       daemon=True)
        self.thread.start()

    def _write(self, rng) -> None:
        from megazero.checkpoint.shards import write_rank_shard
        from megazero.checkpoint.writer import _write
        try:
            self.snapshot.copy()
            files, params = write_rank_shard(self.tmp, self.snapshot, self.named, self.mesh, self.lock.run_id)
            name = rng_file(self.mesh.coord("tp"), self.mesh.coord("pp"), self.mesh.coord("dp", "cp"))
            _write(rng, os.path.join(self.tmp, name))
            files[name] = describe_file(os.path.join(self.tmp, name))
            self.result = (files, params)
        except BaseException as err:  # noqa: BLE001 - reported by finish() on every rank
            self.error = err

    def done(self) -> bool:
        """Whether every rank's writer thread has finished (collective)."""
        return all_ok(not self.thread.is_alive(), self.mesh)

    def finish(self) -> float:
        """Wait for the files, then seal the checkpoint (collective); returns the seconds since the write
        began.  Raises :class:`CheckpointError` on every rank if any rank failed (the partial files are
        removed; the previous checkpoint and the tracker are unchanged)."""
        from megazero.checkpoint.writer import _gather_to_rank0, _metadata, _seal
        self.thread.join()
        try:
            agree(self.error, self.mesh, f"saving iteration {self.iteration} to {self.tmp}",
                  CheckpointSaveError)
            gathered = _gather_to_rank0(self.result, self.mesh)
            error = None
            if self.mesh.rank == 0:
                try:
                    files, params = {}, {}
                    for f, p in gathered:
                        files.update(f)
                        params.update(p)
                    write_json(os.path.join(self.tmp, CONFIG), saved_settings(self.cfg))
                    files[CONFIG] = describe_file(os.path.join(self.tmp, CONFIG))
                    meta = _metadata(self.iteration, self.snapshot, self.mesh, self.cfg, self.extra,
                                     self.lock.run_id, files, params)
                    _seal(self.tmp, meta, self.lock)
                except Exception as err:  # noqa: BLE001
                    error = err
            agree(error, self.mesh, f"sealing checkpoint {self.final}", CheckpointSaveError)
        except CheckpointError:
            if self.mesh.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            upd, self.snapshot = self.snapshot.update, None
            self.host = (upd.master, upd.state)  # the next save copies into these buffers
        return time.perf_counter() - self.started

    def abandon(self, wait: Optional[float] = 60.0) -> None:
        """A failure elsewhere: let the thread end its files (bounded), publish nothing (no collective)."""
        self.thread.join(timeout=wait)
