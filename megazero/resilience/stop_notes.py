"""A rank's word to its launcher that training stopped early because a launcher was lost.

When one node's launcher dies (the node fails, or the agent is killed), its ranks receive SIGTERM
from the kernel (:func:`megazero.resilience.signals.exit_with_parent`); with
``--exit-signal-handler`` every rank of the job then agrees to stop, saves and exits 0, so the
surviving launchers would see ranks that all succeeded and report a finished job.  Each rank
therefore also agrees on whether a launcher is gone (:mod:`megazero.resilience.stop`) and, when
one is, leaves a note in ``MEGAZERO_STOP_NOTES`` (a directory that ``scripts/launch.py`` creates for
its own ranks).  The launcher reads the notes when its ranks exit: an interrupted run is a failure
(:mod:`megazero.resilience.rounds` restarts it under ``--max-restarts``, else the launcher exits 1).
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

NOTES_ENV = "MEGAZERO_STOP_NOTES"


def write_note(iteration: int, reason: str, environ=os.environ) -> Optional[str]:
    """Record that this rank stopped after ``iteration`` for ``reason`` (a launcher is gone); the path,
    or None outside ``scripts/launch.py`` (no directory) or when it cannot be written."""
    directory = environ.get(NOTES_ENV, "")
    if not directory:
        return None
    path = os.path.join(directory, f"rank_{environ.get('RANK', '0')}.json")
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump({"iteration": int(iteration), "reason": reason, "pid": os.getpid()}, fh)
        os.replace(path + ".tmp", path)  # the launcher never reads half a note
    except OSError:
        return None
    return path


def read_notes(directory: str) -> List[dict]:
    """The notes in ``directory`` (an unreadable one counts, with its reason unknown)."""
    out = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(directory, name)) as fh:
                out.append(dict(json.load(fh)))
        except (OSError, ValueError, TypeError):
            out.append({"iteration": None, "reason": "a launcher was lost"})
    return out


def clear_notes(directory: str) -> None:
    """Forget the notes of a finished attempt (before the next one starts)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass
