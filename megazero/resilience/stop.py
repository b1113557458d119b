"""When to stop early and cleanly: a preemption signal, ``--exit-duration-in-mins``, ``--exit-interval``.

Every rank must stop after the same iteration, or the ranks that go on would wait forever on the
ones that left.  The iteration limit is the same everywhere by construction; a signal may reach
one rank only and clocks differ, so those two are agreed by one all-reduce (MAX) over the world group
after every iteration of two numbers, the signal received (its number, 0 for none) and whether the
time is up (a few bytes; skipped when neither is configured).
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from megazero.resilience.signals import ExitSignals


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
        return float(signum), float(late), float(bool(io_error))

    def reason(self, iteration: int, mesh, io_error: Optional[str] = None) -> Optional[str]:
        """Why to stop after ``iteration`` (the same on every rank; collective when signals, a
        duration or files to watch are configured), or None to go on.  ``io_error``: this rank's
        failed write outside the save (rank 0's metrics file), which stops every rank with a save
        (:attr:`failed` is then set)."""
        signalled, late, broken = self._local_flags(io_error)
        if self.needs_agreement and mesh.is_distributed:
            flags = mesh.collective_tensor([signalled, late, broken], dtype=torch.float32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mesh.world_group)
            signalled, late, broken = (float(v) for v in flags.tolist())
        if broken:
            self.failed = True
            return f"{io_error or 'rank 0 could not write its metrics'}: an emergency save"
        if signalled:
            return f"{signal.Signals(int(signalled)).name} received (--exit-signal-handler)"
        if late:
            return f"--exit-duration-in-mins {self.duration:g} reached"
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval} reached"
        return None
