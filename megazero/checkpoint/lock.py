"""One writer per ``--save`` directory: ``DIR/.megazero.lock``.

Global rank 0 of a run takes the directory's lock (:class:`megazero.process.run_lock.RunLock`: an exclusive
``flock`` on the lock file, which names the holder) for as long as the run may save.  A second run
that tries is refused at start-up with a message naming the holder.  The kernel drops the lock when
the holder dies (``kill -9``, a crash), so a restarted job takes it again at once.  Every shard
index and the metadata carry the run id, and rank 0 checks the lock file still names its run before
it publishes a checkpoint: on a file system whose ``flock`` is not shared between hosts, a second
writer is still caught before it can publish a mixed checkpoint.
"""
from __future__ import annotations

import os
from typing import Optional

from megazero.checkpoint.errors import CheckpointError
from megazero.process.run_lock import RunLock, describe_owner

LOCK = ".megazero.lock"


class SaveLock(RunLock):
    """The lock of ``directory`` (held by global rank 0; other ranks keep only ``run_id``)."""

    def __init__(self, directory: str, run_id: str, fd: Optional[int] = None):
        super().__init__(os.path.join(directory, LOCK), run_id, fd)
        self.directory = directory

    @classmethod
    def acquire(cls, directory: str, run_id: Optional[str] = None) -> "SaveLock":
        """Take the lock (rank 0).  Raises :class:`CheckpointError` naming the holder when another
        live run has it."""
        path = os.path.join(directory, LOCK)
        held = RunLock.acquire(
            path, run_id,
            busy=lambda who: CheckpointError(
                f"--save {directory}: another run is saving to this directory ({who}; lock {path}). Two "
                "runs must not share a --save directory: wait for that run to end, stop it, or choose "
                "another --save"),
            error=lambda message: CheckpointError(f"--save {directory}: {message}"))
        return cls(directory, held.run_id, held.fd)

    def check_owner(self) -> None:
        """Raise unless the lock file still names this run (before publishing a checkpoint)."""
        owner = self.owner()
        if owner.get("run_id") != self.run_id:
            raise CheckpointError(
                f"--save {self.directory}: another run ({describe_owner(owner)}) has taken over this "
                "directory; this run's checkpoint is not published. Give each run its own --save directory")
