"""One run per swap file: each swap file under ``--nvme-path`` is locked before it is opened.

A :class:`~megazero.offload.nvme.NvmeStore` takes the lock of its file (``.{file}.lock`` beside it,
the mechanism of :mod:`megazero.process.run_lock`, as ``--save`` does) before it opens, truncates or
allocates anything, and drops it when the file is removed: a second run given the same
``--nvme-path`` is refused, naming the holder, instead of truncating the first run's swap files.
Runs whose files differ (an optimizer tier and a parameter tier) may share a directory.
:func:`megazero.offload.nvme.open_store` opens the stores of every rank of a run at once and
refuses on every rank when any rank is refused (:func:`first_refusal`), so that rank 0 says it once.
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from megazero.errors import CONFIG, LOCAL, MegazeroError
from megazero.process.run_lock import RunLock

FLAG = "--nvme-path"


class SwapBusyError(MegazeroError):
    """Another live run holds a swap file this run needs (``kind``: ``local`` when one store saw it,
    ``config`` once every rank of the run agreed on it, rank 0 reporting it, exit status 2)."""

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message)
        self.kind = CONFIG if everywhere else LOCAL


def lock_path(file: str) -> str:
    return os.path.join(os.path.dirname(file), f".{os.path.basename(file)}.lock")


def lock_swap_file(file: str) -> RunLock:
    """Take the lock of swap file ``file``; raises :class:`SwapBusyError` naming the holder."""
    directory, path = os.path.dirname(file), lock_path(file)

    def busy(who: str) -> SwapBusyError:
        return SwapBusyError(f"{FLAG} {directory}: another run is using the swap file {file} ({who}; "
                             f"lock {path}). Two runs must not share a {FLAG} directory: wait for that run "
                             f"to end, stop it, or give this run its own {FLAG}")
    try:
        return RunLock.acquire(path, busy=busy, error=lambda m: SwapBusyError(f"{FLAG} {directory}: {m}"))
    except OSError as err:
        raise OSError(err.errno, f"{FLAG} {directory}: locking {file} failed: {err.strerror}") from None


def first_refusal(mine: Optional[str], mesh) -> Optional[str]:
    """The message of the first rank of ``mesh`` whose store was refused (``mine``: this rank's, or
    None), on every rank alike (a collective over the world group)."""
    if not mesh.is_distributed:
        return mine
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, mine, group=mesh.world_group)
    return next((m for m in everyone if m is not None), None)
