"""The requests behind :class:`~megazero.offload.nvme.NvmeStore`, run on its I/O threads: whole
aligned pages in place, a last partial page through a bounce page, and the probe that tells
whether a file system really performs direct I/O."""
from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor

from megazero.offload.aligned import ALIGN, aligned_empty, byte_view
from megazero.offload.checks import io_error


def transfer(fd: int, mv: memoryview, offset: int, write: bool, file: str, before=None) -> None:
    """One request, repeated until every byte moved (a short count continues where it stopped)."""
    if before is not None:
        before.synchronize()
    try:
        while len(mv):
            n = os.pwrite(fd, mv, offset) if write else os.preadv(fd, [mv], offset)
            if n == 0:
                raise OSError(errno.EIO, "unexpected end of file")
            mv, offset = mv[n:], offset + n
    except OSError as e:
        raise io_error(e, file, "writing" if write else "reading") from e


def transfer_tail(fd: int, mv: memoryview, offset: int, write: bool, file: str, before=None) -> None:
    """The last partial page of a tensor, through an aligned bounce page (zero-padded on writes)."""
    page = aligned_empty(ALIGN)
    pv = byte_view(page)
    if write:
        if before is not None:
            before.synchronize()
        page.zero_()
        pv[:len(mv)] = mv
    transfer(fd, pv, offset, write, file)
    if not write:
        mv[:] = pv[:len(mv)]


def direct_works(fd: int, file: str) -> bool:
    """Whether an aligned direct write and read of one page succeed (some file systems accept the
    ``O_DIRECT`` flag at open and refuse the requests)."""
    page = aligned_empty(ALIGN)
    page.zero_()
    try:
        transfer(fd, byte_view(page), 0, True, file)
        transfer(fd, byte_view(page), 0, False, file)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True


def unlink_quietly(file: str) -> None:
    try:
        os.unlink(file)
    except FileNotFoundError:
        pass


def remove_store(fd: int, file: str, pool: ThreadPoolExecutor, lock=None) -> None:
    """Finish the requests, close and remove the swap file, then drop its lock (``lock``)."""
    pool.shutdown(wait=True)
    os.close(fd)
    unlink_quietly(file)
    if lock is not None:
        lock.release()
