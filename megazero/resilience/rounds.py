"""torchrun's agent, adjusted so that a job re-forms after a node is lost (``scripts/launch.py`` only).

When a node dies, the ranks of the other nodes fail (a collective loses its peer) or, with
``--exit-signal-handler``, stop and save (:mod:`megazero.resilience.stop_notes`); their agents then
restart them under ``--max-restarts`` through a new round of the c10d rendezvous, which completes
once the node is back (or, with ``--nnodes MIN:MAX``, once MIN nodes are there).  Three things in
torchrun stand in the way, and :func:`install` changes them in this process:

* ranks that saved and exited 0 because a launcher was lost look like a finished job: the agent's
  monitor turns them into a failed attempt (restarted, or the launcher's failure);
* the workers' store: torchrun's group rank 0 serves it, and a node keeps the address it learned in
  its first round, even after the node that served it died or another node became rank 0; every
  round now learns it afresh (group rank 0 serves a new store each round);
* the workers' store prefix followed ``TORCHELASTIC_RESTART_COUNT``, which differs between a node
  that restarted after a failure and one that was started again (0): the ranks of one round would
  wait for each other under different prefixes.  The agent exports the rendezvous round, the same on
  every node, as ``MEGAZERO_RDZV_ROUND`` (:func:`megazero.resilience.watchdog.join_process_group`).
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Optional

from megazero.resilience.stop_notes import clear_notes, read_notes

ROUND_ENV = "MEGAZERO_RDZV_ROUND"


class Interruptions:
    """What the agent saw: the note of the last attempt interrupted by a lost launcher, if any."""

    def __init__(self, notes_dir: str, say: Optional[Callable[[str], None]] = None):
        self.notes_dir, self.say = notes_dir, say
        self.last: Optional[dict] = None
        self.count = 0

    def describe(self) -> str:
        note = self.last or {}
        where = f" after iteration {note['iteration']}" if note.get("iteration") is not None else ""
        return f"training stopped{where}: {note.get('reason', 'a launcher was lost')}"


def _round_of(handler) -> Optional[int]:
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    return getattr(state, "round", None)


def _patch_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    original = DynamicRendezvousHandler.next_rendezvous
    if getattr(original, "_megazero", False):
        return

    def next_rendezvous(handler):
        if handler.use_agent_store and hasattr(handler, "_bootstrap_store_info"):
            handler._bootstrap_store_info = None  # group rank 0 serves, and publishes, a store this round
        info = original(handler)
        if info.rank != 0 and getattr(handler, "_shared_tcp_store_server", None) is not None:
            handler._shared_tcp_store_server = None  # rank 0 before, not now: its old store closes
        number = _round_of(handler)
        if number is not None:
            os.environ[ROUND_ENV] = str(number)  # the workers this agent starts next inherit it
        return info
    next_rendezvous._megazero = True
    DynamicRendezvousHandler.next_rendezvous = next_rendezvous


def restart_line(result, agent, seen: Interruptions) -> Optional[str]:
    """The line the launcher prints when torchrun is about to restart this node's ranks after a failed
    attempt (None when no restart is left: the launcher's last line says it then)."""
    left = int(getattr(agent, "_remaining_restarts", 0))
    spec = getattr(getattr(agent, "_worker_group", None), "spec", None)
    if left <= 0 or spec is None:
        return None
    failures = sorted((result.failures or {}).items(), key=lambda item: item[1].timestamp)
    if not failures:
        what = "this node's ranks stopped answering"
    elif getattr(failures[0][1], "megazero_interrupted", False):
        what = seen.describe()
    else:
        rank, code = failures[0][0], int(failures[0][1].exitcode)
        what = f"rank {rank} " + (f"was killed by {signal.Signals(-code).name}" if code < 0
                                  else f"exited with status {code}")
    settings = getattr(spec.rdzv_handler, "settings", None)
    many = settings is not None and settings.max_nodes > 1
    wait = (" in a new rendezvous round, once enough nodes are back (--nnodes; it waits up to --rdzv-conf "
            "join_timeout, 600 s by default)") if many else ""
    return (f"{what}; restarting this node's ranks (restart {spec.max_restarts - left + 1} of "
            f"{spec.max_restarts}): they resume from the last checkpoint{wait}")


def _patch_monitor(seen: Interruptions) -> None:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    current = LocalElasticAgent._monitor_workers
    original = getattr(current, "_megazero_original", current)

    def monitor(agent, worker_group):
        result = _interrupted(agent, worker_group, original(agent, worker_group))
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and seen.say is not None:
            line = restart_line(result, agent, seen)
            if line:
                seen.say(line)
        return result

    def _interrupted(agent, worker_group, result):
        if result.state != WorkerState.SUCCEEDED:
            return result
        notes = read_notes(seen.notes_dir)
        if not notes:
            return result
        clear_notes(seen.notes_dir)
        seen.last, seen.count = notes[0], seen.count + 1
        error_files = getattr(getattr(agent, "_pcontext", None), "error_files", {}) or {}
        failures = {}
        for worker in worker_group.workers:
            failure = ProcessFailure(local_rank=worker.local_rank, pid=worker.id or 0, exitcode=1,
                                     error_file=str(error_files.get(worker.local_rank, "")))
            failure.message = seen.describe()
            failure.megazero_interrupted = True  # for the launcher's last line
            failures[worker.global_rank] = failure
        return RunResult(state=WorkerState.FAILED, failures=failures)
    monitor._megazero_original = original
    LocalElasticAgent._monitor_workers = monitor


def install(notes_dir: str, say: Optional[Callable[[str], None]] = None) -> Interruptions:
    """Apply the changes above to torchrun's classes (this process); the notes of this launcher's ranks
    are read from ``notes_dir`` (exported to them as ``MEGAZERO_STOP_NOTES``); ``say`` prints the line
    for each restart of this node's ranks."""
    from megazero.resilience.stop_notes import NOTES_ENV
    os.environ[NOTES_ENV] = notes_dir
    seen = Interruptions(notes_dir, say)
    _patch_rendezvous()
    _patch_monitor(seen)
    return seen


def host_on_node_zero(args, node_rank: Optional[int]) -> None:
    """c10d: the rendezvous store is served by node rank 0's launcher, never by whichever launcher on
    the rendezvous host started first (several "nodes" on one host; torchrun's guess by host name):
    ``is_host`` is added to ``--rdzv-conf`` unless given there, or no node rank is known."""
    if getattr(args, "standalone", False) or args.rdzv_backend != "c10d" or node_rank is None:
        return
    if "is_host" in (args.rdzv_conf or ""):
        return
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    from megazero.resilience.loopback import rendezvous_host
    if node_rank == 0 and not _matches_machine_hostname(rendezvous_host(args)):
        return  # node 0 is not the rendezvous host: torchrun's own rule stands
    flag = "is_host=1" if node_rank == 0 else "is_host=0"
    args.rdzv_conf = ",".join(part for part in (args.rdzv_conf, flag) if part)


def rendezvous_failure_line(err, args) -> Optional[str]:
    """One line for an error of torchrun's rendezvous or its store (None for any other error)."""
    from torch.distributed.elastic.rendezvous import api as rdzv
    import torch.distributed as dist
    from megazero.resilience.loopback import rendezvous_host
    port = (args.rdzv_endpoint or "").rsplit(":", 1)[-1] if args.rdzv_endpoint else args.master_port
    where = f"{rendezvous_host(args)}:{port}"
    again = "start every node again with the same --load: the job resumes from its last checkpoint"
    if isinstance(err, rdzv.RendezvousClosedError):
        return (f"the job's rendezvous at {where} is closed: the other nodes finished or gave up, "
                f"nothing is left to join ({again})")
    if isinstance(err, rdzv.RendezvousTimeoutError):
        return (f"the job did not form at {where} within the rendezvous' join timeout (--rdzv-conf "
                "join_timeout=SECS, 600 by default): fewer nodes than --nnodes came (back); start the "
                "missing ones, or give --nnodes MIN:MAX to go on without them")
    store_errors = tuple(getattr(dist, n) for n in ("DistNetworkError", "DistStoreError") if hasattr(dist, n))
    if isinstance(err, (rdzv.RendezvousConnectionError,) + store_errors):
        return (f"lost the rendezvous store at {where}: the launcher of node rank 0 (on the rendezvous host, "
                f"--master-addr) serves it, and it is gone (its node was lost or it exited); {again}")
    if isinstance(err, rdzv.RendezvousError):
        said = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"the rendezvous at {where} failed: {said}"
    return None
