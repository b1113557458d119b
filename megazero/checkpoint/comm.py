"""The collectives that keep every rank's view of a save or a load the same: an error on any rank
is raised on every rank (with the first failing rank's message), and file-system decisions are
taken by global rank 0 and shared."""
from __future__ import annotations

import errno
from typing import Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError, CheckpointSaveError


def all_ok(ok: bool, mesh) -> bool:
    """True on every rank when ``ok`` is true on every rank (a collective; also a barrier)."""
    if not mesh.is_distributed:
        return ok
    failed = mesh.collective_tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(failed, group=mesh.world_group)
    return int(failed.item()) == 0


def agree(error: Optional[BaseException], mesh, what: str, failure=CheckpointError) -> None:
    """Raise on every rank when any rank failed (collective): the same error everywhere, with the first
    failing rank's message, so rank 0 can report the real cause once; its class is ``failure``
    (:class:`CheckpointSaveError` while saving), or kept for a corrupt checkpoint."""
    ok = all_ok(error is None, mesh)
    if ok:
        return
    mine = None if error is None else (mesh.rank, _message(error), type(error).__name__)
    reports = [mine]
    if mesh.is_distributed:
        reports = [None] * mesh.world_size
        dist.all_gather_object(reports, mine, group=mesh.world_group)
    rank, message, kind = next(r for r in reports if r is not None)
    where = f"rank {rank}: " if mesh.is_distributed else ""
    text = message if message.startswith(what) or not what else f"{what}: {message}"
    raise _error_class(kind, failure)(where + text) from error


def _message(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return (f"no space left on device ({err.filename or 'writing a checkpoint file'}); the partial "
                "checkpoint was removed and the previous one is intact: free space or choose another --save")
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def on_rank0(fn, mesh):
    """``fn()`` run by global rank 0 only, its result (or error) given to every rank by one broadcast
    over the world group (a collective): file-system decisions (tracker, metadata, a writable
    directory) cannot differ between ranks, e.g. on a shared file system that caches attributes.
    An error is raised on every rank as :class:`CheckpointError` with rank 0's message."""
    result, message, error, kind = None, None, None, None
    if mesh.rank == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, none may hang
            error, kind = err, type(err).__name__
            message = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    if mesh.is_distributed:
        box = [(result, message, kind)]
        dist.broadcast_object_list(box, src=0, group=mesh.world_group, device=mesh.collective_device)
        result, message, kind = box[0]
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(message) from error
    if message is not None:
        raise _error_class(kind)(message)
    return result


def _error_class(kind: Optional[str], failure=CheckpointError):
    """The checkpoint error class named ``kind`` (so every rank raises the same type), else ``failure``."""
    known = {"CheckpointCorrupt": CheckpointCorrupt, "CheckpointSaveError": CheckpointSaveError}
    return known.get(kind, failure)
