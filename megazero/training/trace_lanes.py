"""Make a ``torch.profiler`` Chrome trace load in Perfetto without dropped slices.

Perfetto's JSON importer needs the complete (``"ph": "X"``) slices of one ``(pid, tid)`` track to be
disjoint or strictly nested, after it converts each ``ts`` and ``dur`` from microseconds to
nanoseconds (each rounded half away from zero).  A slice that crosses the end of the slice around it
is dropped (``SLICE_DROP_OVERLAPPING_COMPLETE_EVENT``).  Kineto writes such slices: under gloo the
``gloo:send`` / ``gloo:recv`` work of a point-to-point op runs from its launch inside ``c10d::send``
until it completes, long after that op has returned, on the same thread's track.

:func:`separate_crossing_slices` moves every slice that would be dropped to an extra track of the
same process (named after its thread, ``... (overlapping 1)``, ...), packed so that no track has a
crossing, and moves the flow arrows that start or end on it along.  Nothing is removed and no time
is changed.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple


def to_ns(us) -> int:
    """Microseconds to nanoseconds as Perfetto's importer rounds them."""
    if isinstance(us, int):
        return us * 1000
    scaled = float(us) * 1000.0
    whole = math.trunc(scaled)
    rest = scaled - whole
    return whole + (1 if rest >= 0.5 else -1 if rest <= -0.5 else 0)


def _fits(lane: List[Tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` nests in ``lane`` (a stack of open slices); pushes it if so."""
    while lane and lane[-1][1] <= start:
        lane.pop()
    if lane and end > lane[-1][1]:
        return False
    lane.append((start, end))
    return True


def separate_crossing_slices(trace: dict) -> int:
    """Rewrite ``trace`` (a Chrome trace dict with ``traceEvents``) in place so that no track has
    crossing complete slices; returns how many slices moved."""
    events = trace["traceEvents"]
    tracks: Dict[tuple, List[dict]] = {}
    for event in events:
        if event.get("ph") == "X" and "ts" in event:
            tracks.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    used = {event.get("tid") for event in events}
    next_tid = max([t for t in used if isinstance(t, int)] + [0]) + 1
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    moved_to: Dict[tuple, int] = {}  # (pid, old tid, start ns) -> new tid, for the flow arrows
    added: List[dict] = []
    for (pid, tid), slices in tracks.items():
        starts = [to_ns(e["ts"]) for e in slices]
        spans = sorted(((start, start + to_ns(e.get("dur", 0)), i) for i, (start, e) in
                        enumerate(zip(starts, slices))), key=lambda s: (s[0], -s[1]))
        lanes: List[Tuple[int, List[Tuple[int, int]]]] = [(tid, [])]
        for start, end, i in spans:
            lane = next((t for t, stack in lanes if _fits(stack, start, end)), None)
            if lane is None:
                lanes.append((next_tid, [(start, end)]))
                lane, next_tid = next_tid, next_tid + 1
                added.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane,
                              "args": {"name": f"{names.get((pid, tid)) or f'thread {tid}'} "
                                               f"(overlapping {len(lanes) - 1})"}})
            if lane != tid:
                slices[i]["tid"] = lane
                moved_to[(pid, tid, start)] = lane
    for event in events:  # flow arrows bind to the slice that starts at their timestamp
        if event.get("ph") in ("s", "f", "t") and "ts" in event:
            lane = moved_to.get((event.get("pid"), event.get("tid"), to_ns(event["ts"])))
            if lane is not None:
                event["tid"] = lane
    events.extend(added)
    return len(moved_to)
