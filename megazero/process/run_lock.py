"""One run at a time on a path: an exclusive ``flock`` on a lock file that names its holder.

A process of a run takes an exclusive, non-blocking ``flock`` on a lock file for as long as the run
uses what the file guards, and writes its run id, host, pid and start time into it.  A second run
that tries is refused with a message naming the holder.  The kernel drops the lock when the holder
dies (``kill -9``, a crash), so a restarted job takes it again at once.  Where the file system has
no ``flock`` the lock still records its owner, and :meth:`RunLock.owner` tells whether another run
has written over it.

The one mechanism behind the ``--save`` directory's lock (:class:`megazero.checkpoint.SaveLock`)
and the ``--nvme-path`` swap files' locks (:func:`megazero.offload.lock.lock_swap_file`); they
differ only in the file locked and the error raised.  This module imports only the shared error
base.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from typing import Callable, Optional

from megazero.errors import MegazeroError


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class RunLock:
    """The lock file ``path`` held by this process (``fd``) for run ``run_id`` (``fd`` None: held
    elsewhere, by another rank of the run, or a file system without ``flock``)."""

    def __init__(self, path: str, run_id: str, fd: Optional[int] = None):
        self.path, self.run_id, self.fd = path, run_id, fd

    @classmethod
    def acquire(cls, path: str, run_id: Optional[str] = None,
                busy: Callable[[str], BaseException] = lambda who: MegazeroError(f"held by {who}"),
                error: Callable[[str], BaseException] = MegazeroError) -> "RunLock":
        """Take the lock.  When another live run holds it, raises ``busy(who)`` (``who``: that run's
        id, pid, host and start time); ``error(message)`` when the file keeps changing."""
        import fcntl
        run_id = run_id or new_run_id()
        for _ in range(10):  # the file may be replaced between open and flock (a holder releasing it)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise busy(describe_owner(read_owner(path))) from None
                fd = None  # this file system has no flock: rely on the run id check
            if fd is None or _same_file(fd, path):
                lock = cls(path, run_id, fd)
                lock._write_owner()
                return lock
            os.close(fd)
        raise error(f"could not take {path} (it keeps changing)")

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

    def owner(self) -> dict:
        """What the lock file says now (``{}`` when it is gone or unreadable)."""
        return read_owner(self.path)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
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


def read_owner(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.loads(fh.read() or "{}")
    except (OSError, ValueError):
        return {}


def describe_owner(owner: dict) -> str:
    """``run R, pid P on HOST, since T`` (or ``unknown owner``)."""
    if not owner:
        return "unknown owner"
    return (f"run {owner.get('run_id')}, pid {owner.get('pid')} on {owner.get('host')}, "
            f"since {owner.get('since')}")
