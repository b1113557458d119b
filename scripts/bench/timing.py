"""Timing shared by the benchmarks: steps timed in interleaved rounds, barrier to barrier."""
from __future__ import annotations

import time
from typing import Callable, Dict, List


def interleaved_rounds(steps: Dict[str, Callable[[], object]], rounds: int,
                       barrier: Callable[[], object] = lambda: None) -> Dict[str, List[float]]:
    """Seconds of each call of every step over ``rounds`` rounds.  Each round calls every step
    once, in an order rotated from round to round, so a load change on a shared machine hits every
    step alike; each call is timed from a ``barrier`` to the next (the same span on every rank)."""
    names = list(steps)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(rounds):
        shift = r % len(names)
        for k in names[shift:] + names[:shift]:
            barrier()
            start = time.perf_counter()
            steps[k]()
            barrier()
            times[k].append(time.perf_counter() - start)
    return times


def timed_backward(forward: Callable[[], "object"], module, x, repeats: int):
    """(fastest seconds of ``repeats`` forward+backward passes of ``forward()``, bytes autograd saved
    for backward in the last one): the tensors the saved-tensor hooks see, each storage counted once,
    leaving out ``module``'s parameters and the input ``x``."""
    import torch
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    saved: Dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    times = []
    for _ in range(repeats):
        saved.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
        out.sum().backward()
        times.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
        x.grad = None
    return min(times), sum(saved.values())
