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
