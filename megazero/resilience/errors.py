"""Errors that end a run with one clear message, and how a rank reports them.

A failure is reported once, without a traceback, when it is a
:class:`~megazero.errors.MegazeroError`; its class's ``kind`` says how (this module imports none of
the subsystems that raise them):

* raised identically on every rank (``config``: a bad flag; ``everywhere``: a checkpoint problem,
  a diverged run): global rank 0 prints it; every other rank stays silent and waits (bounded) for
  its launcher to end it, so that ``torchrun`` never kills rank 0 before rank 0 has printed (under the
  engine, whose scripts may raise on one rank only, a rank still alive after the wait prints it then,
  with its rank);
* seen by one rank only (``local``: a collective that timed out, a peer that vanished, bad data in
  this rank's batch): that rank prints it, prefixed with its rank.

Anything else is a bug and keeps its full traceback.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Optional, TextIO

from megazero.errors import CONFIG, EVERYWHERE, LOCAL, MegazeroError, exit_status_of

WAIT_FOR_RANK0 = 60.0  # seconds a silent rank waits for its launcher (torchrun ends it once rank 0 exits)


class FatalError(MegazeroError, RuntimeError):
    """Stops the run with one message and no traceback; every rank raises the same message (rank 0
    reports it) unless the subclass's ``kind`` is ``local`` (the rank that raised it reports it)."""


class NumericalError(FatalError):
    """The loss or the gradient norm became NaN or inf (``--check-for-nan-in-loss-and-grad``)."""


class CollectiveError(FatalError):
    """A collective or point-to-point operation timed out or lost its peer (this rank's view)."""

    kind = LOCAL


class DataError(FatalError, ValueError):
    """The data this rank read is unusable (e.g. a token id outside the vocabulary)."""

    kind = LOCAL


def _kind(err: BaseException) -> str:
    """``config``, ``everywhere``, ``local`` (:mod:`megazero.errors`) or ``bug``."""
    return err.kind if isinstance(err, MegazeroError) else "bug"


def rank_of_env() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def report_failure(err: BaseException, prog: str = "pretrain_gpt.py", rank: Optional[int] = None,
                   world_size: Optional[int] = None, stream: Optional[TextIO] = None,
                   wait: float = WAIT_FOR_RANK0, speak_after_wait: bool = False) -> int:
    """Print ``err`` the way its kind asks (see the module docstring) and return its exit status
    (:func:`megazero.errors.exit_status_of`: 2 for a configuration error or an unusable checkpoint, 1
    otherwise).
    A rank that stays silent first waits up to ``wait`` seconds when other ranks exist: its launcher
    ends it once rank 0 has printed and exited; with ``speak_after_wait`` (the engine's scripts, whose
    errors need not be raised on every rank) a rank still alive when the wait runs out prints its line
    then, with its rank.  megazero's own programs raise such errors on every rank alike and keep one
    line: under a launcher that ends no rank (``run_ranks``, srun) every rank would print it."""
    rank = rank_of_env() if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", "1") or 1) if world_size is None else world_size
    stream = sys.stderr if stream is None else stream
    kind = _kind(err)
    code = exit_status_of(err)
    if kind == "bug":
        lines = traceback.format_exception(type(err), err, err.__traceback__)
        stream.write(f"[rank {rank}] " + "".join(lines))
    elif kind == LOCAL:
        stream.write(f"{prog}: error: rank {rank}: {err}\n")
    elif rank == 0:
        stream.write(f"{prog}: error: {err}\n")
    stream.flush()
    if kind != "bug":
        write_error_file(str(err))
    if kind in (CONFIG, EVERYWHERE) and rank != 0 and world > 1 and wait > 0:
        alive = _wait_for_launcher(wait if "TORCHELASTIC_RUN_ID" in os.environ else min(wait, 5.0))
        if alive and speak_after_wait:
            # nobody ended this rank: rank 0 may not have raised it (an engine script's error on one
            # rank), so this rank says it rather than exit in silence
            stream.write(f"{prog}: error: rank {rank}: {err}\n")
            stream.flush()
    return code


def write_error_file(message: str) -> None:
    """``message`` in torchrun's error file for this rank (``TORCHELASTIC_ERROR_FILE``, in the format
    of torch's ``ErrorHandler``): the launcher reads it (a stall's diagnosis names the stopped rank)
    and its timestamp orders the failures.  Nothing outside torchrun; a write that fails is ignored.

    Written to a temporary file in the same directory, then renamed over the error file: torchrun's
    agent parses the file of every rank it ends (it may end this one mid-write) and fails on a file
    it finds empty or half-written, so the file holds either nothing or the whole message."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass


def exit_process(code: int) -> None:
    """End the process now with ``code``, after flushing stdout and stderr.

    For entry points, after the run has torn down its own threads and process groups: it skips the
    interpreter's finalization, where the C++ destructors of the communication libraries can abort
    ("terminate called without an active exception", SIGABRT) while peers are still exiting."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not change the exit status
            pass
    os._exit(int(code))


def _wait_for_launcher(seconds: float) -> bool:
    """Sleep until the launcher ends this process (it does once rank 0 exits), at most ``seconds``;
    True when the time ran out with the process still alive and its parent the same."""
    deadline = time.monotonic() + seconds
    parent = os.getppid()
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.05)
    return os.getppid() == parent
