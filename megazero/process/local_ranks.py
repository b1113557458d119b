"""Run a function on N gloo ranks in forked processes and collect each rank's result.

Forking a process that already has torch imported costs far less than spawning a fresh
interpreter (which re-imports torch), so tests and CPU benchmarks use :func:`run_ranks`.
Each rank runs with one intra-op thread, joins a gloo process group through a FileStore in
a temporary directory (no ports), and sends back its return value or its exception with the full
traceback.  The value travels as a ``torch.save`` file read back with ``torch.load(weights_only=True)``
(no code runs from it): tensors, dict, list, tuple, set, str, numbers, None, torch dtypes, devices
and sizes, and ``range``, ``slice``, ``frozenset`` (:data:`EXTRA_PLAIN`); a rank that returns
anything else fails, naming the type.  A run that exceeds ``timeout`` seconds
is killed and reported as a failure, never left hanging.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import re
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist

from megazero.process.threads import set_rank_threads


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _child(fn, rank, world_size, store_path, result_path, args, kwargs):
    set_rank_threads()
    # gloo ranks on CPUs by design: a GPU machine's default device (megazero.mesh.default_device)
    # must not send them to CUDA (hidden before this process first touches CUDA)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))

    def failure() -> dict:  # timestamped at the raise, before tear-down can upset the peers
        return {"ok": False, "error": traceback.format_exc(), "time": time.time()}

    joined = False
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        joined = True
        payload = {"ok": True, "value": fn(*args, **kwargs)}
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        payload = failure()
    tmp = result_path + ".tmp"
    try:
        torch.save(payload, tmp)
        _read(tmp)  # what the parent can read back: refused here, with the rank's traceback
    except Exception:  # the value could not be saved or read: report that instead
        torch.save({"ok": False, "error": traceback.format_exc(), "time": time.time()}, tmp)
    os.replace(tmp, result_path)  # the parent never reads a half-written result
    if joined:  # after the result is out (gloo's tear-down can hang, seen with torch 2.4); no barrier:
        try:    # a failed rank must not wait for the others
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):  # what the rank printed reaches the test's capture
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not turn a result into a failure
            pass
    os._exit(0)


EXTRA_PLAIN = (range, slice, frozenset)  # builtins of plain values, beside torch's weights-only list


def _read(path: str) -> dict:
    """A rank's result file, read by torch's weights-only unpickler (plain data, no code)."""
    try:
        with torch.serialization.safe_globals(list(EXTRA_PLAIN)):
            return torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - a refused type is named; anything else is re-raised
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if named is None:
            raise
        raise TypeError(f"a rank's return value holds {named.group(1)}, which torch.load(weights_only=True) "
                        "does not read; return tensors and plain Python values") from None


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180.0, **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results in rank order.

    Inside ``fn`` the default process group is initialised and ``RANK``/``WORLD_SIZE`` are set.
    Raises :class:`RankError` with the first failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="megazero-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        paths = [os.path.join(tmp, f"result{r}.pt") for r in range(world_size)]
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store, paths[r], args, kwargs),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = timed_out = False
        done: dict = {}
        try:
            while len(done) < world_size:  # a rank is done once its result is written (or it died)
                for r, p in enumerate(procs):
                    if r not in done and (os.path.exists(paths[r]) or not p.is_alive()):
                        exists = os.path.exists(paths[r])
                        done[r] = _read(paths[r]) if exists else None
                        failed = failed or done[r] is None or not done[r]["ok"]
                if failed:
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.01)
            if failed:  # give the failing rank's peers a moment to report their own view
                grace = time.monotonic() + 2.0
                while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                    time.sleep(0.01)
        finally:  # ranks still alive: timed out, failed, or past their result in tear-down
            grace = time.monotonic() + 1.0
            while not failed and any(p.is_alive() for p in procs) and time.monotonic() < grace:
                time.sleep(0.01)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        if timed_out:
            raise RankError(f"timed out after {timeout:.0f}s; ranks still running were killed")
        errors = []
        for r, path in enumerate(paths):
            if r not in done and os.path.exists(path):
                done[r] = _read(path)
            res = done.get(r)
            if res is not None:
                if not res["ok"]:
                    errors.append((res["time"], r, res["error"]))
            else:
                errors.append((float("inf"), r, f"exited without a result (exit code {procs[r].exitcode})"))
        if errors:
            # the earliest failure is the cause; later ones are usually peers losing their connection
            errors.sort()
            _, r, err = errors[0]
            others = [e[1] for e in errors[1:]]
            raise RankError(f"rank {r} of {world_size} failed first:\n{err}"
                            + (f"\n(ranks {others} failed after it)" if others else ""))
        return [done[r]["value"] for r in range(world_size)]
