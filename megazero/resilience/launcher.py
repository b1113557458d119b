"""torchrun, speaking once: :func:`run_torchrun` runs ``torch.distributed.run`` in this process with

* its log lines silenced (the OMP_NUM_THREADS banner, "Sending process ... closing
  signal" per rank) and, instead of the ``ChildFailedError`` summary with its traceback, one line
  naming the first rank that failed and its status, which becomes the launcher's own (a status 2,
  a usage error that rank 0 has already printed, adds nothing); after a stall the line starts with
  the rank that stopped responding, as named by a failed rank's diagnosis (from its error file);
* a termination signal forwarded to the ranks *once*, after which the agent keeps watching them:
  ranks that save and exit 0 make the launcher exit 0 with one line.  Repeated signals within
  ``grace`` seconds (SLURM signals every process of a step; the agent would forward each again)
  are the same request; one after that takes torchrun's own path (its ranks are ended, then killed
  after its shutdown timeout) and the launcher exits 128 + the signal number, again in one line.
  After a termination signal no rank is restarted (``--max-restarts``): ranks without
  ``--exit-signal-handler`` die of the forwarded signal, and that ends the job.

A bad launcher argument is one line naming the flag, exit status 2 (:mod:`megazero.resilience.launch_args`).

Over several nodes (docs/operations.md, "Several nodes, and when a node dies"): every store this
process serves listens on the address given (:mod:`megazero.resilience.loopback`); node rank 0 serves
the rendezvous store and the join (:mod:`megazero.resilience.join`), which a node started again after
a failure passes at once; torchrun's agent re-forms the job in a new rendezvous round once the node is
back, and a run stopped because a launcher was lost counts as failed, never as finished
(:mod:`megazero.resilience.rounds`); a restart and a rendezvous error are one line each.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from typing import List, Optional, Sequence, TextIO, Tuple

from megazero.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from megazero.resilience.launch_args import read_launch_args

PROG = "launch.py"


def child_pids(pid: int) -> List[int]:
    """The direct children of ``pid`` (from /proc; empty elsewhere)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return out


class ForwardOnce:
    """torchrun's termination handler, replaced: the first signal is forwarded to the ranks (the
    children of this process) and training goes on to their clean exit; repeats within ``grace``
    seconds are ignored; a later one raises torchrun's ``SignalException`` (its shutdown path)."""

    def __init__(self, grace: float):
        self.grace = float(grace)
        self.first: Optional[float] = None
        self.signum: Optional[int] = None

    def __call__(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        now = time.monotonic()
        if self.first is None:
            self.first, self.signum = now, signum
            for pid in child_pids(os.getpid()):
                try:
                    os.kill(pid, signum)
                except OSError:
                    pass
            return
        if now - self.first <= self.grace:
            return
        from torch.distributed.elastic.multiprocessing.api import SignalException
        sig = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _no_restart_after(handler: ForwardOnce) -> None:
    """After a termination signal, ranks that fail (those without --exit-signal-handler die of it)
    end the job instead of being restarted under --max-restarts (this launcher process only)."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    restart = agent_api.SimpleElasticAgent._restart_workers

    def restart_unless_signalled(agent, worker_group):
        if handler.signum is not None:
            sig = signal.Signals(handler.signum)
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)
        return restart(agent, worker_group)
    agent_api.SimpleElasticAgent._restart_workers = restart_unless_signalled


def _quiet() -> None:
    """torchrun's loggers (each created with a level of its own) silenced: this launcher's lines replace
    them."""
    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith("torch.distributed")]
    for name in names + ["torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher"]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _message(failure) -> str:
    """The message a rank left in its error file (megazero's errors write one), else ""."""
    msg = failure.message
    return str(msg.get("message", "")) if isinstance(msg, dict) else str(msg or "")


def stalled_rank(failures) -> Optional[Tuple[int, str]]:
    """(reporting rank, "rank R (pid P on HOST) has stopped") from the first of ``failures`` (rank ->
    ProcessFailure, the first failure first) whose stall diagnosis names a rank that stopped
    responding (stopped, silent or never reported; one that exited is among the failures itself)."""
    for rank, failure in failures:
        said = re.search(r"Not answering: (.*?)\. Look at", _message(failure))
        first = said.group(1).split("; ")[0] if said else ""
        if re.match(r"rank \d+ ", first) and not first.endswith("has exited"):
            return rank, first
    return None


def failure_line(err) -> str:
    """One line for torchrun's ``ChildFailedError``: the first rank that failed and its status, led by
    the rank that stopped responding when a failed rank's diagnosis names one (the first to fail
    after a stall is a healthy rank whose collective timed out), and where its log is."""
    rank, failure = err.get_first_failure()
    code = int(failure.exitcode)
    what = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    others = len(err.failures) - 1
    more = f" ({others} other rank{'s' if others != 1 else ''} also failed)" if others > 0 else ""
    stderr = os.path.join(os.path.dirname(str(failure.error_file)), "stderr.log")
    log = f"; its log: {stderr}" if os.path.isabs(stderr) and os.path.exists(stderr) else ""
    ordered = [(rank, failure)] + [(r, f) for r, f in sorted(err.failures.items()) if r != rank]
    stall = stalled_rank(ordered)
    lead = ""
    if stall is not None:
        who = re.match(r"rank (\d+)", stall[1]).group(1)
        lead = f"rank {who} stopped responding (rank {stall[0]}'s diagnosis: {stall[1]}); "
    return f"{lead}rank {rank} {what} first{more}; its messages are above{log}"


def run_torchrun(argv: Sequence[str], grace: float = 120.0, stream: Optional[TextIO] = None,
                 join_timeout: float = 600.0, join_interval: float = 30.0) -> int:
    """``torchrun ARGV`` (the same flags), reported in one line; returns the exit status.  On several
    nodes every node's launcher first waits for the others (:mod:`megazero.resilience.join`): up to
    ``join_timeout`` seconds (0: no wait), a line every ``join_interval``; then 1 naming the missing."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    stream = sys.stderr if stream is None else stream
    _quiet()
    args, problem = read_launch_args(argv)
    if problem:
        stream.write(f"{PROG}: error: {problem}\n")
        stream.flush()
        return EXIT_USAGE
    from megazero.resilience import rounds
    from megazero.resilience.join import join_before_torchrun, node_rank_of
    from megazero.resilience.loopback import serve_on_given_address

    def say(text: str) -> None:
        stream.write(f"{PROG}: {text}\n")
        stream.flush()
    serve_on_given_address(args, warn=say)  # the stores listen on the address given, not on every interface
    own = list(argv)[:list(argv).index(args.training_script)] if args.training_script in argv else list(argv)
    rounds.host_on_node_zero(args, node_rank_of(own))
    keep: List[object] = []  # this launcher's place in the join (the host: its store), for the whole launch
    if not join_before_torchrun(args, argv, join_timeout, join_interval, stream, keep=keep):
        return EXIT_FAILURE
    os.environ["MEGAZERO_AGENT_PID"] = str(os.getpid())  # the ranks' parent: they exit when it is gone
    handler = ForwardOnce(grace)
    mp_api._terminate_process_handler = handler  # installed by torchrun for each attempt's workers
    _no_restart_after(handler)
    entry = os.path.basename(str(args.training_script))
    notes = tempfile.mkdtemp(prefix="megazero-stop-notes-")
    seen = rounds.install(notes, lambda text: handler.signum is None and say(text))  # none after a signal
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = int(failure.exitcode)
        if any(int(f.exitcode) == EXIT_USAGE for f in err.failures.values()):  # rank 0 printed it
            return EXIT_USAGE  # (the other ranks, waiting for the launcher, may be recorded as failing first)
        if getattr(failure, "megazero_interrupted", False):
            say(f"{entry}: {seen.describe()}; no restart left (--max-restarts {args.max_restarts}): start "
                "every node again with the same --load to resume from the last checkpoint")
            return EXIT_FAILURE
        say(f"{entry}: {failure_line(err)}")
        return code if 0 < code < 256 else EXIT_FAILURE
    except mp_api.SignalException as err:
        name = signal.Signals(err.sigval).name
        if handler.first is not None and time.monotonic() - handler.first <= grace:
            stream.write(f"{PROG}: {name} received: not every rank stopped cleanly (without "
                         "--exit-signal-handler a rank dies of it, unsaved); none is restarted after it\n")
        else:
            stream.write(f"{PROG}: {name} again over {grace:g} s after the first: the ranks were ended "
                         "without waiting for their save\n")
        stream.flush()
        return 128 + int(err.sigval)
    except Exception as err:  # noqa: BLE001 - a rendezvous or store error is one line; others re-raised
        line = rounds.rendezvous_failure_line(err, args)
        if line is None:
            raise
        say(line)
        del keep[:]  # its host is likely gone with the rendezvous: nothing to say goodbye to
        return EXIT_FAILURE
    finally:
        shutil.rmtree(notes, ignore_errors=True)
        for joined in keep:
            joined.leave()
    if handler.signum is not None:
        stream.write(f"{PROG}: {signal.Signals(handler.signum).name} received: every rank stopped cleanly "
                     "(a checkpoint was saved where --save was given)\n")
        stream.flush()
    return EXIT_OK
