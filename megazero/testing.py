"""Run a function on N gloo ranks in forked processes and collect each rank's result.

Forking a process that already has torch imported costs far less than spawning a fresh
interpreter (which re-imports torch), so tests and CPU benchmarks use :func:`run_ranks`.
Each rank runs with one intra-op thread, joins a gloo process group through a FileStore in
a temporary directory (no ports), and sends back its return value (anything ``torch.save``
can write) or its exception with the full traceback.  A run that exceeds ``timeout`` seconds
is killed and reported as a failure, never left hanging.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _child(fn, rank, world_size, store_path, result_path, args, kwargs):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    payload: dict
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            payload = {"ok": True, "value": fn(*args, **kwargs)}
        finally:
            # no barrier here: a failed rank must not wait for the others
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        payload = {"ok": False, "error": traceback.format_exc()}
    try:
        torch.save(payload, result_path)
    except Exception:  # the value could not be saved: report that instead
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180.0, **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results in rank order.

    Inside ``fn`` the default process group is initialised and ``RANK``/``WORLD_SIZE`` are set.
    Raises :class:`RankError` with the first failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="megazero-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        paths = [os.path.join(tmp, f"result{r}.pt") for r in range(world_size)]
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store, paths[r], args, kwargs), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failure = None
        try:
            while True:
                alive = [p for p in procs if p.is_alive()]
                for r, path in enumerate(paths):
                    if failure is None and not procs[r].is_alive() and os.path.exists(path):
                        res = torch.load(path, weights_only=False)
                        if not res["ok"]:
                            failure = f"rank {r} of {world_size} failed:\n{res['error']}"
                    if failure is None and not procs[r].is_alive() and procs[r].exitcode not in (0, None) \
                            and not os.path.exists(path):
                        failure = f"rank {r} of {world_size} died with exit code {procs[r].exitcode}"
                if failure is not None or not alive:
                    break
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout:.0f}s; ranks still running: " \
                              f"{[r for r, p in enumerate(procs) if p.is_alive()]}"
                    break
                time.sleep(0.01)
        finally:
            if failure is not None:
                time.sleep(0.2)  # let a failing rank's peers finish writing if they can
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        if failure is not None:
            raise RankError(failure)
        results = []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                raise RankError(f"rank {r} of {world_size} exited without a result (exit code {procs[r].exitcode})")
            res = torch.load(path, weights_only=False)
            if not res["ok"]:
                raise RankError(f"rank {r} of {world_size} failed:\n{res['error']}")
            results.append(res["value"])
        return results
