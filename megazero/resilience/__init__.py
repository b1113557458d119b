"""Operations at scale: no silent hangs, clean stops on preemption and time limits, numerical faults
caught, one clear message per failure.

- :mod:`megazero.resilience.watchdog`: ``--distributed-timeout-minutes`` on every group, a store
  prefix per torchrun restart, the flight recorder and NCCL watchdog settings, the heartbeat, and
  the message that explains a collective that timed out or lost its peer;
- :mod:`megazero.resilience.signals`: ``--exit-signal-handler`` (a signal becomes a flag) and
  dying with the launcher (``PR_SET_PDEATHSIG``);
- :mod:`megazero.resilience.stop`: signal, ``--exit-duration-in-mins`` and ``--exit-interval``,
  agreed over the world;
- :mod:`megazero.resilience.numerics`: ``--check-for-nan-in-loss-and-grad`` and ``--skip-nan-steps``;
- :mod:`megazero.resilience.errors`: which rank prints which failure, once, and the exit status;
- :mod:`megazero.resilience.faults`: ``MEGAZERO_FAULT`` fault injection for drills and tests;
- :mod:`megazero.resilience.guard`: :class:`RunGuard`, the trainer's single entry point.

Nothing here keeps module-level mutable state: the guard owns the handlers and the thread.
"""
from megazero.resilience.errors import (CollectiveError, DataError, FatalError, NumericalError,  # noqa: F401
                                        exit_process, report_failure)
from megazero.resilience.guard import RunGuard  # noqa: F401
from megazero.resilience.signals import ExitSignals, exit_with_parent  # noqa: F401
from megazero.resilience.watchdog import init_distributed, join_process_group, timeout_of  # noqa: F401

__all__ = ["CollectiveError", "DataError", "ExitSignals", "FatalError", "NumericalError", "RunGuard",
           "exit_process", "exit_with_parent", "init_distributed", "join_process_group", "report_failure",
           "timeout_of"]
