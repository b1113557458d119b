"""Signals: a preemption notice becomes a flag the trainer acts on; ranks die with their launcher.

:class:`ExitSignals` (``--exit-signal-handler``) turns the first of the ``--exit-signal`` signals
into a flag (the trainer finishes the iteration, saves and exits 0).  Further signals are the same
request until ``--exit-signal-grace-secs`` after the save started; one after that ends the process at
once with the signal's default action.  The handler only records: it never runs collectives
or I/O, so it is safe at any point of the program.

:func:`exit_with_parent` asks Linux to send SIGTERM to this process when the process that started
it dies (``prctl(PR_SET_PDEATHSIG)``), so ranks never keep training after ``kill -9`` of their
``torchrun`` agent; with the exit-signal handler on SIGTERM they save first.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Dict, List, Optional

PR_SET_PDEATHSIG = 1


class ExitSignals:
    """Handlers for the named signals that set :attr:`received` (the signal's name) on the first one.

    Repeated signals are one request (SLURM signals every process of a step, torchrun forwards the
    same signal again, the agent's death adds one) until ``grace`` seconds after :meth:`saving` was
    called (or, while no save has started, e.g. a process stuck in a collective, after the first
    signal); only a signal after that ends the process at once with its default action."""

    def __init__(self, names: List[str], grace: float = 30.0):
        self.names = list(names)
        self.grace = float(grace)
        self.received: Optional[str] = None
        self.repeats = 0
        self.save_started: Optional[float] = None
        self.received_at: Optional[float] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers (main thread only; returns False elsewhere, where Python forbids it)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for name in self.names:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def saving(self) -> None:
        """The stop save begins: the grace period for repeated signals starts now."""
        if self.save_started is None:
            self.save_started = time.monotonic()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, time.monotonic()
            return
        self.repeats += 1
        since = self.save_started if self.save_started is not None else self.received_at
        if time.monotonic() - since <= self.grace:
            return  # the same request again
        self.restore()  # past the grace period: the default action, now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def __enter__(self) -> "ExitSignals":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


AGENT_PID = "MEGAZERO_AGENT_PID"  # set by scripts/launch.py for its ranks: the agent's process id


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie: Linux's /proc; False where unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X", "x")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def parent_is_gone(environ=os.environ) -> bool:
    """Whether the process that started this one has died already: the parent is not the agent that
    ``scripts/launch.py`` names in ``MEGAZERO_AGENT_PID``, or that agent has exited (killed, its main
    thread exits first: Linux moves its children to one of its threads still exiting, and sends the
    parent death signal, while the parent id still names it), or (other launchers) this process was
    re-parented to init."""
    parent = os.getppid()
    agent = environ.get(AGENT_PID, "")
    if agent.isdigit():
        return parent != int(agent) or _exited(int(agent))
    return parent == 1


def exit_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Linux: deliver ``sig`` to this process when its parent dies.  Returns True when set.  If the
    parent died before the request took effect, even before this process got this far in its
    start-up (:func:`parent_is_gone`), the signal is sent now."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_is_gone():  # the parent is already gone: act as if the signal came
        os.kill(os.getpid(), sig)
    return True
