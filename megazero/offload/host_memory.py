"""Host memory the C allocator keeps after PyTorch frees it (glibc on Linux).

PyTorch's CPU tensors come from ``malloc``.  glibc serves a request of at least its *mmap threshold*
with a mapping of its own, returned to the system when freed, and smaller ones from its heaps, whose
free space at the top goes back to the system once it exceeds the *trim threshold*.  Both move:
the mmap threshold starts at 128 KiB and rises, up to 32 MiB, to the size of every mapped block
freed, the trim threshold with it (twice as large).  What comes back to the system must be faulted
in again, a page at a time, when the next step allocates its activations.

:func:`set_host_malloc` fixes both for a run (``--host-malloc``, measured by
``scripts/bench_host_malloc.py`` and ``scripts/estimate_memory.py --measure``; docs/performance.md):

- ``keep``: blocks under 32 MiB from the heaps, and the heaps never trimmed on their own, so a step
  reuses the memory the last one freed: no page faults for its activations, at the price of the
  heaps' fragments in the resident memory.
- ``release``: blocks of 1 MiB or more get mappings of their own, returned when freed: the least
  resident memory, but every step faults its activations in again.
- ``system``: left as the C library has them (glibc's moving thresholds, or whatever allocator is
  preloaded).
- ``auto`` (the default, :func:`host_malloc_policy`): ``keep`` on CPUs where every rank holds whole
  model states (ZeRO 0-2, nothing offloaded), where activations are host memory and the speed is
  the point; ``release`` under ZeRO-3 or offloading, which are there to save memory, and on
  accelerators, whose host memory holds no activations.

:func:`release_free` hands the heaps' free pages back (``malloc_trim``); the optimizer calls it
before it allocates the gradient buffer.  Both do nothing where the C library is not glibc, and
:func:`set_host_malloc` leaves thresholds chosen in the environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``) alone.

:func:`rss_bytes`, :func:`peak_rss_bytes` and :func:`reset_peak_rss` read and reset this process's
resident memory and its high-water mark (``/proc/self/status``, ``/proc/self/clear_refs``; Linux).
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Optional

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
HOST_MALLOC = ("auto", "keep", "release", "system")  #: the choices of ``--host-malloc``
KEEP_MMAP_THRESHOLD = 32 << 20  #: ``keep``: the largest threshold glibc accepts on 64-bit systems
RELEASE_MMAP_THRESHOLD = 1 << 20  #: ``release``: blocks of at least this many bytes are mapped alone
DEFAULT_TRIM_THRESHOLD = 128 << 10  #: glibc's initial trim threshold
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  #: set there, they win


def _glibc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return lib if hasattr(lib, "gnu_get_libc_version") and hasattr(lib, "mallopt") else None


def host_malloc_policy(cfg, device_type: str) -> str:
    """The policy ``cfg.precision.host_malloc`` names for a run on ``device_type``: ``auto`` resolved
    (module docstring), any other choice itself."""
    from megazero.offload.settings import optimizer_device, param_device
    choice, par = cfg.precision.host_malloc, cfg.parallel
    if choice != "auto":
        return choice
    whole_states = par.zero_stage < 3 and optimizer_device(par) == param_device(par) == "none"
    return "keep" if device_type == "cpu" and whole_states else "release"


def set_host_malloc(policy: str) -> bool:
    """Fix glibc's thresholds for ``policy`` (``keep`` or ``release``; ``system`` leaves them; the module
    docstring).  Returns whether they were set: not where the C library is not glibc or the
    environment sets one."""
    if policy not in HOST_MALLOC[1:]:
        raise ValueError(f"--host-malloc must be one of {', '.join(HOST_MALLOC)}, got {policy!r}"
                         + (" (resolve auto with host_malloc_policy)" if policy == "auto" else ""))
    lib = _glibc()
    if policy == "system" or lib is None or any(name in os.environ for name in ENVIRONMENT):
        return False
    if policy == "release":  # and glibc's own trim threshold, which a fixed mmap threshold fixes too
        return bool(lib.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(RELEASE_MMAP_THRESHOLD))
                    and lib.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(DEFAULT_TRIM_THRESHOLD)))
    # -1: never trim on free (mallopt(3)); malloc_trim (release_free) still returns the free pages
    return bool(lib.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(KEEP_MMAP_THRESHOLD))
                and lib.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(-1)))


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
