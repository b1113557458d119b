"""A pre-rendezvous before torchrun's, so that a node whose peers never join says who is missing.

Every node's launcher (:func:`megazero.resilience.launcher.run_torchrun`) joins a
``torch.distributed.TCPStore`` at the rendezvous host on the rendezvous port + 1000 (port - 1000
above 64535), hosted by the launcher on that host, and writes ``megazero/join/<node>`` = its
hostname.  It waits for all ``--nnodes`` nodes, printing a line every ``interval`` seconds while
some are missing; after ``timeout`` seconds it prints one line naming the missing nodes (their
hostnames from SLURM's node list where known) and the launcher exits 1.  A node is its node rank
when one is given (torchrun's ``--node-rank``, or ``NODE_RANK`` / ``SLURM_NODEID``), else the order
of arrival (then the nodes that joined are named by hostname).  Skipped for ``--standalone``, one
node, and an elastic range MIN:MAX.

The store is hosted by node rank 0 (or, without node ranks, by the first launcher on the rendezvous
host) and stays up for as long as that launcher runs: once every node has joined it records that the
job formed, and a node started again later (after a node failure) goes straight on to torchrun's
rendezvous, which adds it in its next round, instead of waiting for peers that moved on.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from datetime import timedelta
from typing import List, Optional, Sequence, TextIO

PORT_OFFSET = 1000
KEY = "megazero/join"


def join_port(port: int) -> int:
    """The pre-rendezvous port: the rendezvous port + 1000 (- 1000 when that would not fit)."""
    return port + PORT_OFFSET if port + PORT_OFFSET <= 65535 else port - PORT_OFFSET


def node_rank_of(argv: Sequence[str], env=os.environ) -> Optional[int]:
    """The node rank given to the launcher (``--node-rank``), else ``NODE_RANK`` / ``SLURM_NODEID``."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        for flag in ("--node-rank", "--node_rank"):
            if arg == flag and i + 1 < len(argv):
                return int(argv[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    for name in ("NODE_RANK", "SLURM_NODEID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def slurm_hosts(env=os.environ) -> Optional[List[str]]:
    """The job's hostnames in node order (``scontrol show hostnames``), None outside SLURM."""
    nodelist = env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split() if out.returncode == 0 else None


def _names(ranks: List[int], limit: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def _connect(host: str, port: int, deadline: float, interval: float, say, may_host: bool = True):
    """The store: hosted here when ``may_host`` (node rank 0, or no node rank), ``host`` is this machine
    and the port is free, else a client (retried until ``deadline``, a line every ``interval`` s)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    from megazero.resilience.loopback import bound_store_class
    if may_host and _matches_machine_hostname(host):
        try:  # served on the address given, not on every interface
            store = bound_store_class(TCPStore)(host, port, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=60))
            return store, True
        except (RuntimeError, ValueError):
            pass  # another launcher on this machine hosts it
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, False
        try:
            wait = timedelta(seconds=max(1.0, min(interval, left)))
            return TCPStore(host, port, is_master=False, timeout=wait), False
        except (RuntimeError, ValueError):
            if deadline - time.monotonic() > 0:
                say(f"waiting for the node hosting the join at {host}:{port} (the rendezvous host)")


class JoinedJob:
    """This launcher's place in the join, held for the whole launch.  :meth:`leave` at its end: a node
    says it is done; the host waits (up to ``wait`` seconds) until the other nodes are, so that its
    stores (this one, torchrun's rendezvous store) outlive their last use (torchrun's agents close the
    rendezvous as they exit, and a store gone by then prints a C++ stack trace on those nodes)."""

    def __init__(self, store, hosting: bool, nnodes: int):
        self.store, self.hosting, self.nnodes = store, hosting, nnodes

    def leave(self, wait: float = 10.0) -> None:
        try:
            if not self.hosting:
                self.store.add(f"{KEY}/done", 1)
                return
            deadline = time.monotonic() + wait
            while self.store.add(f"{KEY}/done", 0) < self.nnodes - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        except RuntimeError:  # the host is gone already
            pass


def join_nodes(host: str, port: int, nnodes: int, node_rank: Optional[int], timeout: float,
               interval: float = 30.0, stream: Optional[TextIO] = None, prog: str = "launch.py",
               keep: Optional[list] = None) -> bool:
    """Wait until ``nnodes`` launchers joined at ``host:port`` (see the module docstring); False after
    ``timeout`` seconds, with one line naming the missing nodes, or when this node rank is taken.  The
    node's :class:`JoinedJob` is appended to ``keep``: the caller holds it (the host's store serves for
    the rest of the launch) and calls its :meth:`JoinedJob.leave` at the end; without ``keep`` the
    host's store closes once every node has read the outcome."""
    import sys
    stream = sys.stderr if stream is None else stream

    def say(text: str) -> None:
        stream.write(f"{prog}: {text}\n")
        stream.flush()
    if node_rank is not None and not 0 <= node_rank < nnodes:
        say(f"--node-rank / NODE_RANK {node_rank} is not one of the {nnodes} nodes (0 to {nnodes - 1})")
        return False
    start = time.monotonic()
    deadline = start + timeout
    where = f"{host}:{port}"
    store, hosting = _connect(host, port, deadline, interval, say, node_rank in (None, 0))
    if store is None:
        say(f"no node hosts the join at {where} after {timeout:g} s (--join-timeout): the launcher on the "
            "rendezvous host never started, or the address is wrong")
        return False
    line = None
    try:
        if store.check([f"{KEY}/formed"]):  # started again after the job formed (a node that was lost)
            say(f"the job formed at {where} before this node started: joining it in torchrun's next "
                "rendezvous round")
            if keep is not None:
                keep.append(JoinedJob(store, False, nnodes))
            return True
        line = _wait(store, where, nnodes, node_rank, start, timeout, interval, say)
        if not line:
            store.set(f"{KEY}/formed", "1")
        if keep is not None and not line:
            keep.append(JoinedJob(store, hosting, nnodes))
            if hosting:
                return True  # serving for the rest of the launch: a node started again reads "formed"
        counted = store.add(f"{KEY}/count", 0) if hosting else 0
        store.add(f"{KEY}/left", 1)  # a joined node's last word: after it the host may close the store
        while hosting and store.add(f"{KEY}/left", 0) < counted and time.monotonic() < deadline + 30:
            time.sleep(0.1)  # the host's store stays up until every node that joined has read the outcome
    except RuntimeError:  # the host's launcher is gone (before this node read the outcome: it keeps it)
        if line is None:
            line = (f"the join at {where} ended before every node joined: the launcher on the rendezvous "
                    "host gave up (its line names the missing nodes) or exited")
    if line:
        say(line)
    return not line


def _wait(store, where: str, nnodes: int, node_rank: Optional[int], start: float, timeout: float,
          interval: float, say) -> str:
    """Join and wait: "" once every node joined, else the line naming the missing ones (shared through
    the store: the first node to give up decides for all)."""
    me = f"{socket.gethostname()} (pid {os.getpid()})"
    if node_rank is not None:
        if store.add(f"{KEY}/taken/{node_rank}", 1) > 1:
            return (f"node rank {node_rank} joined twice at {where}: give every node its own --node-rank / "
                    "NODE_RANK")
        store.set(f"{KEY}/{node_rank}", me)
        store.add(f"{KEY}/count", 1)
    else:
        store.set(f"{KEY}/{store.add(f'{KEY}/count', 1) - 1}", me)
    next_line = start + interval
    while store.add(f"{KEY}/count", 0) < nnodes:
        if store.check([f"{KEY}/failed"]):
            return store.get(f"{KEY}/failed").decode()
        now = time.monotonic()
        if now >= start + timeout or now >= next_line:
            present = [r for r in range(nnodes) if store.check([f"{KEY}/{r}"])]
            absent = [r for r in range(nnodes) if r not in present]
            if node_rank is None:
                who = "joined: " + ", ".join(store.get(f"{KEY}/{r}").decode() for r in present)
                missing = f"{len(absent)} of {nnodes} nodes"
            else:
                who = f"{len(present)} joined"
                missing = f"node{'s' if len(absent) != 1 else ''} {_names(absent)} of {nnodes}"
            if now >= start + timeout:
                hosts = slurm_hosts() if node_rank is not None else None
                named = (f"; missing hosts: {_names([hosts[r] for r in absent if r < len(hosts)])}"
                         if hosts else "")
                line = (f"{missing} did not join at {where} within {timeout:g} s (--join-timeout; "
                        f"{who}){named}")
                store.set(f"{KEY}/failed", line)
                return line
            say(f"waiting for {missing} at {where} ({who}, {now - start:.0f} s of --join-timeout "
                f"{timeout:g})")
            next_line = now + interval
        time.sleep(0.2)
    return ""


def join_before_torchrun(args, argv: Sequence[str], timeout: float, interval: float = 30.0,
                         stream: Optional[TextIO] = None, keep: Optional[list] = None) -> bool:
    """:func:`join_nodes` for torchrun's parsed ``args`` (its rendezvous endpoint, or --master-addr
    and --master-port); True at once for --standalone, one node, an elastic range or ``timeout`` 0."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    nnodes = str(args.nnodes).split(":")
    if args.standalone or timeout <= 0 or len(set(nnodes)) != 1 or int(nnodes[0]) <= 1:
        return True
    if args.rdzv_endpoint:
        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    else:
        host, port = args.master_addr, int(args.master_port or 29500)
    argv = list(argv)
    own = argv[:argv.index(args.training_script)] if args.training_script in argv else argv
    return join_nodes(host, join_port(port), int(nnodes[0]), node_rank_of(own), timeout, interval, stream,
                      keep=keep)
