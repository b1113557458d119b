"""When to stop early and cleanly: a preemption signal, ``--exit-duration-in-mins``, ``--exit-interval``.

Every rank must stop after the same iteration, or the ranks that go on would wait forever on the
ones that left.  The iteration limit is the same everywhere by construction; a signal may reach
one rank only and clocks differ, so those two are agreed by one all-reduce (MAX) over the world group
after every iteration of a few numbers: the signal received (its number, 0 for none), whether the
time is up, whether a write failed and whether this rank's launcher is gone (a few bytes; skipped when
none of them is configured).  A stop because a launcher is gone (its node was lost: its ranks got
SIGTERM from the kernel) is an interruption, not a requested stop: every rank leaves a note for its
launcher (:mod:`megazero.resilience.stop_notes`), which then restarts the job or fails.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from megazero.resilience.signals import AGENT_PID, ExitSignals, parent_is_gone
from megazero.resilience.stop_notes import write_note


def launcher_lost(environ=os.environ) -> bool:
    """Whether the launcher that started this rank (``scripts/launch.py``, which names itself in
    ``MEGAZERO_AGENT_PID``) has died; False under any other launcher."""
    return bool(environ.get(AGENT_PID, "").isdigit()) and parent_is_gone(environ)


class StopConditions:
    """Decides, identically on every rank, whether to save and exit after an iteration."""

    def __init__(self, res_cfg, signals: Optional[ExitSignals], started: Optional[float] = None,
                 watch_io: bool = False):
        self.signals = signals
        self.watch_io = watch_io  # rank 0's metrics file or TensorBoard may fail: agree on it
        self.failed = False  # set when the run stops because a write outside the save failed
        self.duration = res_cfg.exit_duration_in_mins
        self.interval = res_cfg.exit_interval
        self.started = time.monotonic() if started is None else started

    @property
    def needs_agreement(self) -> bool:
        return self.signals is not None or self.duration is not None or self.watch_io

    def _local_flags(self, io_error: Optional[str]):
        received = self.signals.received if self.signals is not None else None
        signum = int(getattr(signal, received)) if received else 0
        elapsed = (time.monotonic() - self.started) / 60.0
        late = self.duration is not None and elapsed >= self.duration
        return float(signum), float(late), float(bool(io_error)), float(launcher_lost())

    def reason(self, iteration: int, mesh, io_error: Optional[str] = None) -> Optional[str]:
        """Why to stop after ``iteration`` (the same on every rank; collective when signals, a
        duration or files to watch are configured), or None to go on.  ``io_error``: this rank's
        failed write outside the save (rank 0's metrics file), which stops every rank with a save
        (:attr:`failed` is then set)."""
        signalled, late, broken, lost = self._local_flags(io_error)
        if self.needs_agreement and mesh.is_distributed:
            flags = mesh.collective_tensor([signalled, late, broken, lost], dtype=torch.float32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.world_group)
            signalled, late, broken, lost = (float(v) for v in flags.tolist())
        elif mesh.is_distributed:
            lost = 0.0  # not agreed: one rank alone must never stop (its peers would wait for it)
        if broken:
            self.failed = True
            return f"{io_error or 'rank 0 could not write its metrics'}: an emergency save"
        if lost:  # a node was lost: save and stop, but as an interruption the launcher acts on
            name = signal.Signals(int(signalled)).name if signalled else ""
            said = f"{name} received (--exit-signal-handler); " if name else ""
            reason = (f"{said}the launcher of a rank is gone (its node was lost): the run is interrupted, "
                      "not finished")
            write_note(iteration, reason)
            return reason
        if signalled:
            return f"{signal.Signals(int(signalled)).name} received (--exit-signal-handler)"
        if late:
            return f"--exit-duration-in-mins {self.duration:g} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval} reached"
        return None
