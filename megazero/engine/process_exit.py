"""How a script using the engine ends: its uncaught megazero error in one line, and its process groups
torn down before the interpreter finalises (both installed by :func:`~megazero.engine.initialize`).

The error's line reaches the terminal under any launcher: torch's own ``sys.excepthook`` (installed by
``init_process_group``) redirects ``sys.stderr`` into a buffer while it runs the hook it wraps, so a
hook that ended the process from inside it (``os._exit``) lost the line.  Ours ends the script by
raising ``SystemExit`` from the hook (CPython exits with that status, after the ``atexit`` functions),
writing to the process's own stderr when another hook is calling it.

The abort at exit ("terminate called without an active exception", SIGABRT, in a few runs out of ten
on a loaded machine) is gloo's: after a collective's result is delivered, the gloo worker thread still
drops its reference to the collective's tensors, which needs the GIL (torch releases the tensors'
Python objects); once the interpreter is finalising, a thread that asks for the GIL is ended with
``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls ``std::terminate``.  The
``atexit`` function meets the other ranks (when no error is on its way out), destroys the process
groups and then gives the worker threads time to finish with the GIL free, all while the interpreter
is still whole (torch's issue pytorch/pytorch#190489).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from datetime import timedelta

BARRIER_TIMEOUT_S = 60.0  # at exit, how long a healthy rank waits for the others (then tears down alone)
DRAIN_S = 0.2  # at exit, seconds with the GIL free for gloo's worker threads to drop their last tensors


class ReportUncaught:
    """``sys.excepthook`` of a script using the engine: an uncaught megazero error ends it with one line
    (rank 0's for an error every rank raised; docs/operations.md) and its exit status (2 for a
    configuration error, 1 otherwise); anything else goes to the hook it replaced (its traceback)."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, kind, err, tb):
        from megazero.errors import MegazeroError
        if not isinstance(err, MegazeroError):
            return self.previous(kind, err, tb)
        from megazero.resilience.errors import report_failure
        # called by another hook (torch's buffers sys.stderr meanwhile): write where the process writes
        stream = sys.stderr if sys.excepthook is self or sys.__stderr__ is None else sys.__stderr__
        code = report_failure(err, prog=os.path.basename(sys.argv[0] or "script"), stream=stream,
                              speak_after_wait=True)  # a script's error may be one rank's alone
        raise SystemExit(code)


def report_uncaught_errors() -> None:
    """Make an uncaught megazero error end the script in one line, as megazero's own scripts do (only
    what no ``except`` caught: code that handles the errors sees them as before).  Called again after
    ``init_process_group``, it goes back in front of the hook torch installed there."""
    if not isinstance(sys.excepthook, ReportUncaught):
        sys.excepthook = ReportUncaught(sys.excepthook)


def _error_on_its_way_out() -> bool:
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def tear_down_process_groups(barrier_timeout: float = BARRIER_TIMEOUT_S, drain: float = DRAIN_S) -> None:
    """At interpreter exit: a barrier with the other ranks (skipped after an uncaught error, bounded by
    ``barrier_timeout`` seconds), ``destroy_process_group`` (nothing when the script destroyed the
    groups itself), then ``drain`` seconds with the GIL free.  Never raises: the exit status stays the
    script's."""
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            if not _error_on_its_way_out():
                dist.barrier(async_op=True).wait(timeout=timedelta(seconds=barrier_timeout))
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer already gone, a group already destroyed: exit regardless
        pass
    time.sleep(drain)


def tear_down_at_exit() -> None:
    """Register :func:`tear_down_process_groups` with ``atexit``, once however often it is called."""
    atexit.unregister(tear_down_process_groups)
    atexit.register(tear_down_process_groups)
