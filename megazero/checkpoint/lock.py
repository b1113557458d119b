"""One writer per ``--save`` directory: ``DIR/.megazero.lock``.

Global rank 0 of a run takes an exclusive ``flock`` on the lock file for as long as the run may
save, and writes its run id, host, pid and start time into it.  A second run that tries is refused
at start-up with a message naming the holder.  The kernel drops the lock when the holder dies
(``kill -9``, a crash), so a restarted job takes it again at once.  Every shard index and the
metadata carry the run id, and rank 0 checks the lock file still names its run before it publishes
a checkpoint: on a file system whose ``flock`` is not shared between hosts, a second writer is
still caught before it can publish a mixed checkpoint.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from typing import Optional

from megazero.checkpoint.errors import CheckpointError

LOCK = ".megazero.lock"


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class SaveLock:
    """The lock of ``directory`` (held by global rank 0; other ranks keep only ``run_id``)."""

    def __init__(self, directory: str, run_id: str, fd: Optional[int] = None):
        self.directory, self.run_id, self.fd = directory, run_id, fd

    @property
    def path(self) -> str:
        return os.path.join(self.directory, LOCK)

    @classmethod
    def acquire(cls, directory: str, run_id: Optional[str] = None) -> "SaveLock":
        """Take the lock (rank 0).  Raises :class:`CheckpointError` naming the holder when another
        live run has it."""
        import fcntl
        run_id = run_id or new_run_id()
        path = os.path.join(directory, LOCK)
        for _ in range(10):  # the file may be replaced between open and flock (a holder releasing it)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(_busy_message(directory, path)) from None
                fd = None  # this file system has no flock: rely on the run id check
            if fd is None or _same_file(fd, path):
                lock = cls(directory, run_id, fd)
                lock._write_owner()
                return lock
            os.close(fd)
        raise CheckpointError(f"--save {directory}: could not take {path} (it keeps changing)")

    def _write_owner(self) -> None:
        owner = {"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        data = json.dumps(owner).encode()
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            os.fsync(self.fd)
        else:
            with open(self.path, "wb") as fh:
                fh.write(data)

    def check_owner(self) -> None:
        """Raise unless the lock file still names this run (before publishing a checkpoint)."""
        owner = _read_owner(self.path)
        if owner.get("run_id") != self.run_id:
            raise CheckpointError(
                f"--save {self.directory}: another run ({_who(owner)}) has taken over this directory; "
                "this run's checkpoint is not published. Give each run its own --save directory")

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; rank 0)."""
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):
                os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_owner(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.loads(fh.read() or "{}")
    except (OSError, ValueError):
        return {}


def _who(owner: dict) -> str:
    if not owner:
        return "unknown owner"
    return (f"run {owner.get('run_id')}, pid {owner.get('pid')} on {owner.get('host')}, "
            f"since {owner.get('since')}")


def _busy_message(directory: str, path: str) -> str:
    return (f"--save {directory}: another run is saving to this directory ({_who(_read_owner(path))}; "
            f"lock {path}). Two runs must not share a --save directory: wait for that run to end, stop it, "
            "or choose another --save")
