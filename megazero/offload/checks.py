"""Start-up checks of ``--nvme-path`` and the errors of a disk that fills mid-run.

Every message names the flag and the path, so a user knows what to change before a run starts
rather than after hours of training.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

from megazero.errors import LOCAL, MegazeroError

FLAG = "--nvme-path"


class NvmePathError(MegazeroError, ValueError):
    """``--nvme-path`` cannot hold the swap files (missing, not a directory, not writable, too
    small); reported in one line by the rank that checked it."""

    kind = LOCAL


def human_bytes(n: int) -> str:
    """``n`` bytes as GiB with one decimal (MiB below a tenth of a GiB, so small sizes do not read 0.0)."""
    if n >= 2 ** 30 // 10:
        return f"{n / 2 ** 30:.1f} GiB"
    return f"{n / 2 ** 20:.1f} MiB"


def check_nvme_path(path, bytes_needed: int, reclaimable: int = 0, what: str = "this rank's swap files",
                    flag: str = FLAG) -> str:
    """Validate the swap directory ``path`` before anything is written; returns it as an absolute path.

    Raises :class:`NvmePathError` (a ValueError) naming ``flag`` when ``path`` is missing (not given,
    or does not exist), is not a directory, is not writable by this process, or has less free space
    than ``bytes_needed``.
    ``reclaimable`` bytes (a leftover swap file of a crashed run, which is overwritten) count as free.
    Ranks that share a disk should pass the bytes of all of them (``what`` says whose they are)."""
    if not path:
        raise NvmePathError(f"{flag} is required to offload to nvme: give a directory on a local disk "
                            "with room for the swap files")
    if not os.path.exists(path):
        raise NvmePathError(f"{flag} {path}: no such directory; create it or point {flag} at an existing one")
    if not os.path.isdir(path):
        raise NvmePathError(f"{flag} {path}: not a directory")
    if not _writable(path):
        raise NvmePathError(f"{flag} {path}: not writable by this process (permissions or a read-only "
                            "mount)")
    free = shutil.disk_usage(path).free + max(0, reclaimable)
    if bytes_needed > free:
        raise NvmePathError(f"{flag} {path}: needs {human_bytes(bytes_needed)} for {what}, "
                            f"{human_bytes(free)} free; choose a larger disk or raise ZeRO/DP")
    return os.path.abspath(path)


def _writable(path: str) -> bool:
    if not os.access(path, os.W_OK | os.X_OK):
        return False
    try:  # root passes access() on any mode bits; a real file proves it (and catches odd mounts)
        fd, probe = tempfile.mkstemp(prefix=".megazero-probe-", dir=path)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


class NvmeSpaceError(MegazeroError, OSError):
    """The disk under ``--nvme-path`` filled up while the swap files were written (errno ENOSPC);
    the run stops with this one line from the rank that hit it."""

    kind = LOCAL

    def __init__(self, file: str, doing: str, flag: str = FLAG):
        directory = os.path.dirname(file)
        super().__init__(errno.ENOSPC, f"{flag} {directory}: no space left on device while {doing} {file}; "
                                       f"free space on that disk or choose another {flag}")
        self.path = file  # (not ``filename``: OSError would print it a second time)


def io_error(err: OSError, file: str, doing: str, flag: str = FLAG) -> OSError:
    """``err`` (from ``doing`` on ``file``) as an error that names the flag and the path: a
    :class:`NvmeSpaceError` for ENOSPC/EDQUOT, an ``OSError`` with the same errno otherwise."""
    if err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return NvmeSpaceError(file, doing, flag)
    return OSError(err.errno, f"{flag} {os.path.dirname(file)}: {doing} {file} failed: {err.strerror}")


class SwapCorruptError(MegazeroError):
    """A block of a swap file read back differs from what was written (its checksum), or lies past the
    end of a file that was cut short: reported in one line by the rank that read it, naming the file
    and the block.  The swap files are scratch; the run resumes from its last checkpoint."""

    kind = LOCAL

    def __init__(self, file: str, name: str, block: int, start: int, nbytes: int, problem: str,
                 flag: str = FLAG):
        super().__init__(f"{flag} {os.path.dirname(file)}: swap file {file}, block {block} of {name!r} "
                         f"(bytes {start}-{start + nbytes - 1}): {problem}; the disk or another process "
                         "changed the file, so this run's state is lost: resume from the last checkpoint "
                         "(--load)")
        self.path, self.block = file, block
