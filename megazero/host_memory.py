"""Host memory the C allocator keeps after PyTorch frees it (glibc on Linux).

PyTorch's CPU tensors come from ``malloc``.  glibc serves a request of at least its *mmap threshold*
with a mapping of its own, returned to the system when freed, and smaller ones from its heaps,
whose free space mostly stays with the process.  The threshold starts at 128 KiB but rises, up to
32 MiB, to the size of every mapped block freed, so after the first large tensors of a run come and
go the activations and gradient temporaries of a few MiB land in the heaps, and their fragments
add to the resident memory of every rank whatever the data-parallel size (measured on a 4-layer
GPT-2 XL-shaped model, ZeRO-3 at DP 2: 0.1-0.2 GiB more per rank at the peak).

:func:`limit_retention` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops it
moving) and :func:`release_free` hands the heaps' free pages back (``malloc_trim``).  Both do
nothing where the C library is not glibc, and :func:`limit_retention` leaves a threshold chosen
in the environment (``MALLOC_MMAP_THRESHOLD_``) alone.

:func:`rss_bytes`, :func:`peak_rss_bytes` and :func:`reset_peak_rss` read and reset this process's
resident memory and its high-water mark (``/proc/self/status``, ``/proc/self/clear_refs``; Linux).
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 1 << 20  #: blocks of at least this many bytes get a mapping of their own


def _glibc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "gnu_get_libc_version") and hasattr(lib, "mallopt") else None


def limit_retention(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations of ``threshold`` bytes or more from mappings of their own, whatever was
    freed before (module docstring).  Returns whether the setting was applied."""
    lib = _glibc()
    if lib is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(lib.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(int(threshold))))


def release_free() -> None:
    """Return the free pages of the C heaps to the system (glibc's ``malloc_trim(0)``)."""
    lib = _glibc()
    if lib is not None and hasattr(lib, "malloc_trim"):
        lib.malloc_trim(ctypes.c_size_t(0))


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """This process's resident memory now (0 where ``/proc`` does not report it)."""
    return _status("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since :func:`reset_peak_rss` (Linux's
    ``VmHWM``; elsewhere ``getrusage``'s maximum, 0 where neither is available)."""
    peak = _status("VmHWM")
    if peak:
        return peak
    try:
        import resource
    except ImportError:
        return 0
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale


def reset_peak_rss() -> bool:
    """Start the high-water mark of :func:`peak_rss_bytes` again from the current resident memory (a
    forked process inherits its parent's); returns whether the system allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
