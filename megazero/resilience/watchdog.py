"""Bounded waits: every process group gets ``--distributed-timeout-minutes``, and a failed collective
is explained (which operation, which group, which ranks went silent).

* :func:`join_process_group` joins the group torchrun (or SLURM + torchrun) describes, with the
  timeout, under a store prefix of its own per attempt (the rendezvous round that
  ``scripts/launch.py`` exports, else ``TORCHELASTIC_RESTART_COUNT``), so a restarted job never
  reads the previous attempt's keys (the addresses of dead workers);
* :func:`prepare_environment` turns on the flight recorder (the last collectives of every group,
  gloo and NCCL) and, on NCCL, the watchdog settings that make a stuck collective fail the process
  instead of hanging it: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (abort the communicators and end
  the process on a timeout or error), ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` (dump the flight recorder
  first); existing settings are kept;
* :class:`Heartbeat` publishes, every few seconds, this rank's pid, host, iteration and phase to
  the store from a daemon thread; a stopped (``kill -STOP``), dead or hung process stops beating;
* :func:`describe_failure` turns the exception of a timed-out or broken collective into one
  message: the operation and the group (from the flight recorder), its ranks, and the ranks that
  went silent or are elsewhere (from the heartbeats).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megazero.mesh import backend_for, use_device

FLIGHT_RECORDER_ENTRIES = "2000"
GROUP_LABELS = {"tp": "tensor-parallel", "pp": "pipeline-parallel", "dp": "data-parallel",
                "mp": "model-parallel", "embedding": "embedding", "world": "world", "cp": "context-parallel",
                "dp-cp": "data x context-parallel"}
# the mesh's group of each label (megazero.mesh.ParallelMesh.group's axes)
_GROUP_AXES = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "mp": ("tp", "pp"), "embedding": ("embedding",),
               "cp": ("cp",), "dp-cp": ("dp", "cp")}
TIMEOUT_MARKS = ("timed out", "timeout", "watchdog caught")
# gloo's own phrases that carry no backend name: a pair closed by the transport's timeout ("Application
# timeout caused pair closure") arrives as a bare RuntimeError
GLOO_MARKS = ("gloo", "nccl", "pair.cc", "pair closure")
PEER_MARKS = ("connection reset", "connection closed", "broken pipe", "connection refused", "end of file",
              "communicator was aborted", "socket", "remote worker", "peer")


def timeout_of(cfg) -> timedelta:
    """``--distributed-timeout-minutes`` as a timedelta."""
    return timedelta(minutes=float(cfg.resilience.distributed_timeout_minutes))


def prepare_environment(backend: str) -> None:
    """Flight recorder on (gloo and NCCL); NCCL's watchdog ends a rank whose collective times out."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def init_distributed(device=None, timeout: Optional[timedelta] = None, backend: Optional[str] = None,
                     init_method: Optional[str] = None):
    """The one way megazero joins the default process group, for the trainer and the engine alike:
    the device (None: this process's own, :func:`megazero.mesh.default_device`; a GPU becomes the
    current one), the backend that suits it (NCCL on a GPU, gloo otherwise) unless ``backend`` says,
    ``timeout`` (10 minutes by default) and, from the launcher's environment (``env://``), a store
    prefix per torchrun restart.  Returns the device; nothing is done when a group exists already."""
    device = use_device(device)
    if dist.is_initialized():
        return device
    backend = backend or backend_for(device)
    timeout = timeout or timedelta(minutes=10)
    if init_method in (None, "env://"):
        join_process_group(backend, timeout)
    else:
        prepare_environment(backend)
        dist.init_process_group(backend, init_method=init_method, timeout=timeout)
    return device


def join_process_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from the environment (env://), with ``timeout`` and a store prefix per
    attempt: the rendezvous round under ``scripts/launch.py`` (``MEGAZERO_RDZV_ROUND``, the same on every
    node, also on one started again after a node was lost), else torchrun's restart count."""
    prepare_environment(backend)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("MEGAZERO_RDZV_ROUND") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"megazero/attempt_{attempt}/", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def default_store():
    """The default process group's store, or None (a private torch accessor, used defensively)."""
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - diagnosis is best effort
        return None


class Heartbeat:
    """A daemon thread that writes this rank's liveness and progress to the store every ``interval``
    seconds.  :meth:`mark` (main thread) records the iteration and phase it reports."""

    PREFIX = "megazero/heartbeat/"

    def __init__(self, store, rank: int, interval: float):
        self.store, self.rank, self.interval = store, rank, float(interval)
        self.iteration, self.phase = 0, "start-up"
        self.info = {"pid": os.getpid(), "host": socket.gethostname()}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def mark(self, iteration: Optional[int] = None, phase: Optional[str] = None) -> None:
        if iteration is not None:
            self.iteration = iteration
        if phase is not None:
            self.phase = phase

    def _beat(self) -> None:
        record = dict(self.info, time=time.time(), iteration=self.iteration, phase=self.phase)
        self.store.set(f"{self.PREFIX}{self.rank}", json.dumps(record))

    def _run(self) -> None:
        while True:
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
                return
            if self._stop.wait(self.interval):
                return

    def start(self) -> "Heartbeat":
        self._beat()  # the first beat before training: peers see this rank at once
        self._thread = threading.Thread(target=self._run, name="megazero-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, wait: float = 5.0) -> None:
        """Stop beating and join the thread (bounded: a store that no longer answers cannot block)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait)
            self._thread = None

    def peers(self, ranks: List[int]) -> Dict[int, Optional[dict]]:
        """The last record of each rank (None: never beat or unreadable).  Store calls wait a few
        seconds at most: the run is failing, and the store's host may be gone too."""
        try:
            self.store.set_timeout(timedelta(seconds=5))
        except Exception:  # noqa: BLE001
            pass
        out: Dict[int, Optional[dict]] = {}
        for r in ranks:
            key = f"{self.PREFIX}{r}"
            try:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out


def failure_kind(err: BaseException) -> Optional[str]:
    """``"timeout"`` or ``"peer"`` for a failed collective or point-to-point operation, else None."""
    text = str(err).lower()
    names = ("DistBackendError", "DistNetworkError")
    backend_types = tuple(getattr(dist, n) for n in names if hasattr(dist, n))
    backend_error = isinstance(err, backend_types)
    if not (backend_error or isinstance(err, RuntimeError)):
        return None
    from_backend = backend_error or any(m in text for m in GLOO_MARKS)
    if any(m in text for m in TIMEOUT_MARKS) and (from_backend or "operation" in text):
        return "timeout"
    if backend_error or (from_backend and any(m in text for m in PEER_MARKS)):
        return "peer"
    return None


def _mesh_groups(mesh) -> Dict[str, Tuple[str, List[int]]]:
    """``group_name -> (label, ranks)`` for this rank's groups."""
    out = {}
    for key in GROUP_LABELS:
        if key == "world":
            group, ranks = mesh.world_group, list(range(mesh.world_size))
        else:
            group, ranks = mesh.group(*_GROUP_AXES[key]), list(mesh.ranks(*_GROUP_AXES[key]))
        if group is not None and ranks:
            try:
                out.setdefault(str(group.group_name), (key, ranks))  # a shared group: its first label
            except Exception:  # noqa: BLE001
                continue
    return out


def last_operation(mesh) -> Optional[Tuple[str, str, List[int]]]:
    """``(operation, group label, ranks)`` of this rank's newest flight-recorder entry, or None."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
        entries = json.loads(_dump_fr_trace_json()).get("entries", [])
    except Exception:  # noqa: BLE001 - no flight recorder in this build or for this backend
        return None
    if not entries:
        return None
    entry = max(entries, key=lambda e: e.get("record_id", -1))
    name, desc = (list(entry.get("process_group", ["", ""])) + ["", ""])[:2]
    label, ranks = _mesh_groups(mesh).get(str(name), (desc or f"process group {name}", []))
    op = str(entry.get("profiling_name", "collective")).split(":")[-1]
    return op + (" (point-to-point)" if entry.get("is_p2p") else ""), label, ranks


def _process_state(record: dict) -> Optional[str]:
    """``"exited"`` or ``"stopped"`` for a peer process on this host that is gone or stopped (read
    from /proc), None when it looks alive or lives on another host."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        with open(f"/proc/{int(record['pid'])}/stat") as fh:
            state = fh.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, ValueError, IndexError):
        return "exited"
    return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited"}.get(state)


def _silence_report(heartbeat: Optional[Heartbeat], ranks: List[int], me: int, now: float,
                    world: Optional[int] = None) -> str:
    """Which ranks exited, are stopped or went silent; else where ``ranks`` (the failing group) are.
    Every rank's heartbeat is consulted (``world``): the rank that stopped may be outside the group
    that timed out (it blocks a peer of this group in another group's collective)."""
    if heartbeat is None or not ranks:
        return ""
    everyone = list(range(world)) if world else list(ranks)
    order = [r for r in ranks if r != me] + [r for r in everyone if r not in ranks and r != me]
    records = heartbeat.peers(order)
    stale_after = 2 * heartbeat.interval + 2.0
    gone, heard = [], []
    for r in order:
        rec = records.get(r)
        outside = "" if r in ranks else ", outside this group"
        if rec is None:
            gone.append((3, f"rank {r} (never reported{outside})"))
            continue
        where = f"pid {rec['pid']} on {rec['host']}{outside}"
        age, state = now - rec["time"], _process_state(rec)
        if state is not None:  # a stopped rank is the cause; one that exited may have failed after it
            gone.append((0 if state == "stopped" else 2, f"rank {r} ({where}) has {state}"))
        elif age > stale_after:
            gone.append((1, f"rank {r} ({where}) silent for {age:.1f} s, last at iteration "
                            f"{rec['iteration']} ({rec['phase']})"))
        elif r in ranks:
            heard.append(f"rank {r} {age:.1f} s ago")
    if gone:
        gone.sort(key=lambda g: g[0])  # stable: the group's ranks first within each kind
        return "Not answering: " + "; ".join(g[1] for g in gone) + ". Look at that rank's log first."
    if heard:
        return "Last heartbeats: " + ", ".join(heard) + "."
    return ""


def describe_failure(err: BaseException, kind: str, mesh, heartbeat: Optional[Heartbeat],
                     timeout: Optional[timedelta]) -> str:
    """One message for a collective that timed out (``kind`` "timeout") or lost a peer ("peer")."""
    op = last_operation(mesh)
    where = (f"{op[0]} on the {GROUP_LABELS.get(op[1], op[1])} group (ranks {op[2]})" if op
             else "a collective or point-to-point operation")
    ranks = op[2] if op and op[2] else list(range(mesh.world_size))
    at = "" if heartbeat is None else f" at iteration {heartbeat.iteration} ({heartbeat.phase})"
    if kind == "timeout":
        minutes = timeout.total_seconds() / 60 if timeout else None
        what = (f"{where} timed out{at} after {timeout.total_seconds():g} s "
                f"(--distributed-timeout-minutes {minutes:g})" if timeout else f"{where} timed out{at}")
        hint = " If that rank is only slow, raise --distributed-timeout-minutes."
    else:
        what = f"{where} lost its connection to a peer{at}: a rank exited or was killed"
        hint = ""
    report = _silence_report(heartbeat, ranks, mesh.rank, time.time(), mesh.world_size)
    detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return f"{what}. {report}{hint} ({detail})".replace(". .", ".").replace("  ", " ")
