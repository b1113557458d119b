"""Fault injection for drills and tests: ``MEGAZERO_FAULT="KIND@RANK:ITERATION[,...]"``.

At the start of iteration ``ITERATION`` global rank ``RANK`` sends itself ``KIND`` (``sigkill``,
``sigstop``, ``sigterm``, ``sigusr1``): a crash, a hang, a preemption notice.  Faults fire in the
first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so a job restarted by ``torchrun
--max-restarts`` runs clean.  Unset, nothing happens.
"""
from __future__ import annotations

import os
import signal
from typing import List, Tuple

KINDS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigterm": signal.SIGTERM,
         "sigusr1": signal.SIGUSR1}


def parse_faults(text: str) -> List[Tuple[str, int, int]]:
    """``"sigkill@1:6,sigterm@0:3"`` -> ``[("sigkill", 1, 6), ("sigterm", 0, 3)]``."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            kind, where = item.split("@")
            rank, iteration = where.split(":")
            if kind not in KINDS:
                raise ValueError(kind)
            out.append((kind, int(rank), int(iteration)))
        except ValueError:
            raise ValueError(f"MEGAZERO_FAULT {item!r}: expected KIND@RANK:ITERATION with KIND one of "
                             f"{', '.join(KINDS)}") from None
    return out


class FaultInjector:
    """The faults of ``MEGAZERO_FAULT`` that concern this rank in this attempt."""

    def __init__(self, rank: int, environ=os.environ):
        first_attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        faults = parse_faults(environ.get("MEGAZERO_FAULT", "")) if first_attempt else []
        self.at = {it: kind for kind, r, it in faults if r == rank}

    def __call__(self, iteration: int) -> None:
        kind = self.at.get(iteration)
        if kind is not None:
            os.kill(os.getpid(), KINDS[kind])
