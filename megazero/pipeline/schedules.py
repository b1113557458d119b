"""Pipeline schedules as plain data, and a pure simulator that checks them.

A schedule is, for each pipeline stage, the ordered list of :class:`Action` s that stage runs.
Compute actions are ``fwd`` and ``bwd``; communication actions are ``recv_fwd``/``send_fwd``
(activations) and ``recv_bwd``/``send_bwd`` (activation gradients).  The executor and the
simulator share one rule, :func:`steps`: the communication actions between two compute actions
are posted together (one ``batch_isend_irecv``) and waited on together.  Each schedule places
the receives of the next compute action in the same batch as the sends of the previous one,
which gives Megatron-LM's fused ``send_forward_recv_backward`` / ``send_backward_recv_forward``
in the 1F1B steady state.

Virtual chunks (interleaved schedule): stage ``r`` chunk ``v`` feeds stage ``r + 1`` chunk ``v``;
the last stage's chunk ``v`` feeds the first stage's chunk ``v + 1`` (wrap-around).

No process group is needed here: :func:`simulate` plays every stage with blocking (rendezvous)
semantics, checks that each message matches its receive in FIFO order per directed pair of
ranks (as NCCL and gloo match untagged messages), that nothing deadlocks, that every forward
precedes its backward, counts live activations, and times the run with given F/B costs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

COMPUTE = ("fwd", "bwd")
COMM = ("recv_fwd", "send_fwd", "recv_bwd", "send_bwd")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule cannot be built for these sizes, or a simulated schedule is wrong."""


@dataclass(frozen=True)
class Action:
    """One step of a stage: ``kind`` on ``microbatch`` with model chunk ``chunk`` (virtual stage)."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}({self.microbatch},{self.chunk})"


Step = Union[Action, Tuple[Action, ...]]


def steps(actions: Sequence[Action]) -> List[Step]:
    """Group a stage's actions: compute actions alone, consecutive communication actions as a tuple
    (posted together, waited on together)."""
    out: List[Step] = []
    batch: List[Action] = []
    for a in actions:
        if a.kind in COMPUTE:
            if batch:
                out.append(tuple(batch))
                batch = []
            out.append(a)
        elif a.kind in COMM:
            batch.append(a)
        else:
            raise ScheduleError(f"unknown action kind {a.kind!r}")
    if batch:
        out.append(tuple(batch))
    return out


def peer(action: Action, rank: int, pp: int, vp: int = 1) -> Tuple[int, int]:
    """(stage, chunk) at the other end of a communication action of stage ``rank``."""
    v = action.chunk
    if action.kind in ("send_fwd", "recv_bwd"):  # towards the next model chunk
        return (rank + 1, v) if rank < pp - 1 else (0, v + 1)
    if action.kind in ("recv_fwd", "send_bwd"):  # towards the previous model chunk
        return (rank - 1, v) if rank > 0 else (pp - 1, v - 1)
    raise ScheduleError(f"{action} is not a communication action")


def _with_comms(slots: List[List[Tuple[str, int, int]]], rank: int, pp: int, vp: int) -> List[Action]:
    """Insert p2p actions around compute slots (one or more compute actions run back to back).
    Between two slots one batch sends the previous slot's outputs and receives the next slot's
    inputs, so a stage never blocks on a receive while holding back a send."""
    first = lambda v: rank == 0 and v == 0  # noqa: E731 - model input is the token ids
    last = lambda v: rank == pp - 1 and v == vp - 1  # noqa: E731 - model output is the loss

    def recvs(kind, mb, v):
        if kind == "fwd":
            return [] if first(v) else [Action("recv_fwd", mb, v)]
        return [] if last(v) else [Action("recv_bwd", mb, v)]

    def sends(kind, mb, v):
        if kind == "fwd":
            return [] if last(v) else [Action("send_fwd", mb, v)]
        return [] if first(v) else [Action("send_bwd", mb, v)]

    out: List[Action] = []
    for i, slot in enumerate(slots + [[]]):
        if i:
            out += [a for c in slots[i - 1] for a in sends(*c)]
        out += [a for c in slot for a in recvs(*c)]
        out += [Action(*c) for c in slot]
    return out


def _check_sizes(pp: int, m: int, vp: int = 1) -> None:
    for name, value in (("pipeline-parallel size", pp), ("number of micro-batches", m),
                        ("virtual pipeline size", vp)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def gpipe(pp: int, m: int, forward_only: bool = False) -> List[List[Action]]:
    """GPipe: every stage runs all forwards, then all backwards (in micro-batch order).
    Live activations per stage: ``m``."""
    _check_sizes(pp, m)
    order = [[("fwd", i, 0)] for i in range(m)]
    if not forward_only:
        order += [[("bwd", i, 0)] for i in range(m)]
    return [_with_comms(order, r, pp, 1) for r in range(pp)]


def one_f_one_b(pp: int, m: int, forward_only: bool = False) -> List[List[Action]]:
    """1F1B (PipeDream-flush, Megatron-LM's default): stage ``r`` runs ``min(pp - r - 1, m)``
    warm-up forwards, then alternates one forward and one backward, then the remaining backwards.
    Live activations per stage: ``min(pp - r, m)``."""
    _check_sizes(pp, m)
    if forward_only:
        return gpipe(pp, m, forward_only=True)
    out = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [[("fwd", i, 0)] for i in range(warmup)]
        for i in range(m - warmup):  # Megatron's send_forward_recv_backward between F and B
            order += [[("fwd", warmup + i, 0)], [("bwd", i, 0)]]
        order += [[("bwd", i, 0)] for i in range(m - warmup, m)]
        out.append(_with_comms(order, r, pp, 1))
    return out


def interleaved_warmup(pp: int, rank: int, m: int, vp: int) -> int:
    """Megatron-LM's warm-up forward count for the interleaved schedule (in chunk forwards)."""
    return min((pp - rank - 1) * 2 + (vp - 1) * pp, m * vp)


def interleaved_one_f_one_b(pp: int, m: int, vp: int, forward_only: bool = False) -> List[List[Action]]:
    """Interleaved 1F1B over ``vp`` model chunks per stage (Megatron-LM's ordering).

    Virtual step ``k`` works on micro-batch ``(k // (pp * vp)) * pp + k % pp`` with chunk
    ``(k % (pp * vp)) // pp`` (forward) or ``vp - 1 -`` that (backward): groups of ``pp``
    micro-batches go through one chunk before the next.  Needs ``m % pp == 0`` (forward-only takes any
    ``m``: the last group of micro-batches may be short).
    Live chunk activations per stage: ``min(2 (pp - r - 1) + (vp - 1) pp + 1, m vp)``.
    """
    _check_sizes(pp, m, vp)
    if forward_only:  # Megatron's order, groups of pp micro-batches (the last one may be short): any m
        order = [[("fwd", mb, v)] for g in range(0, m, pp) for v in range(vp)
                 for mb in range(g, min(g + pp, m))]
        return [_with_comms(order, r, pp, vp) for r in range(pp)]
    check_schedule("interleaved", pp, m, vp)

    def fwd_of(k):
        return k % (pp * vp) // pp, k // (pp * vp) * pp + k % pp

    total = m * vp
    out = []
    for r in range(pp):
        F = [("fwd", mb, v) for v, mb in map(fwd_of, range(total))]
        B = [("bwd", mb, vp - 1 - v) for v, mb in map(fwd_of, range(total))]
        w = interleaved_warmup(pp, r, m, vp)
        # steady state: one forward and one backward back to back, then one batch that sends
        # both results and receives both next inputs (Megatron's send_forward_backward_recv_...)
        order = [[f] for f in F[:w]] + [[F[w + i], B[i]] for i in range(total - w)]
        order += [[b] for b in B[total - w:]]
        out.append(_with_comms(order, r, pp, vp))
    return out


def check_schedule(name: str, pp: int, m: int, vp: int = 1) -> None:
    """Raise :class:`ScheduleError` unless schedule ``name`` can train ``m`` micro-batches over ``pp``
    stages of ``vp`` model chunks."""
    _check_sizes(pp, m, vp)
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name != "interleaved" and vp != 1:
        raise ScheduleError(f"the {name} schedule runs one model chunk per stage, got {vp}; "
                            "use the interleaved schedule for virtual stages")
    if name == "interleaved" and m % pp:
        allowed = ", ".join(str(pp * k) for k in range(1, 4))
        raise ScheduleError(
            f"the interleaved schedule needs the number of micro-batches to be a multiple of the "
            f"pipeline-parallel size {pp}, got {m}; allowed counts: {allowed}, ...")


def build_schedule(name: str, pp: int, m: int, vp: int = 1, forward_only: bool = False) -> List[List[Action]]:
    """The per-stage action lists of schedule ``name`` ("gpipe", "1f1b" or "interleaved")."""
    if name == "interleaved":
        return interleaved_one_f_one_b(pp, m, vp, forward_only)
    check_schedule(name, pp, m, vp)
    return (gpipe if name == "gpipe" else one_f_one_b)(pp, m, forward_only)


@functools.lru_cache(maxsize=16)
def stage_schedule(name: str, pp: int, m: int, vp: int, forward_only: bool, rank: int) -> Tuple[Step, ...]:
    """Stage ``rank``'s :func:`steps` of schedule ``name``, built once per set of arguments: the
    executor asks for the same schedule every iteration, and building one is Python work over every
    action of every stage (``pp x m x vp`` of them, each stage's list built and all but one thrown
    away).  A memo of a pure function; the steps are immutable (frozen actions in tuples), so callers
    share them safely."""
    return tuple(steps(build_schedule(name, pp, m, vp, forward_only)[rank]))


def bubble_fraction(pp: int, m: int, vp: int = 1) -> float:
    """Theoretical idle fraction of a stage: ``(pp - 1) / (vp * m + pp - 1)`` (GPipe and 1F1B with
    ``vp = 1``; the interleaved schedule divides the bubble time by ``vp``)."""
    return (pp - 1) / (vp * m + pp - 1)


class SimResult(NamedTuple):
    """Outcome of :func:`simulate`: per-stage peak live activations (chunk forwards awaiting their
    backward), busy time, and the makespan under the given costs."""
    max_live: List[int]
    busy: List[float]
    makespan: float

    def bubble(self) -> List[float]:
        """Idle fraction of each stage."""
        return [1 - b / self.makespan for b in self.busy]


def simulate(schedule: Sequence[Sequence[Action]], vp: int = 1, m: Optional[int] = None,
             fwd_time: float = 1.0, bwd_time: float = 2.0, comm_time: float = 0.0,
             forward_only: bool = False) -> SimResult:
    """Play a schedule on ``len(schedule)`` stages with blocking batches; raise :class:`ScheduleError`
    on a deadlock, a mismatched message or a missing/misordered action.  A chunk forward costs
    ``fwd_time / vp``, a backward ``bwd_time / vp``; a message arrives ``comm_time`` after both ends
    posted it."""
    pp = len(schedule)
    prog = [steps(acts) for acts in schedule]
    pos, clock = [0] * pp, [0.0] * pp
    posted = [False] * pp
    done: List[set] = [set() for _ in range(pp)]  # (kind, mb, chunk) completed on each stage
    live, max_live, busy = [0] * pp, [0] * pp, [0.0] * pp
    # per directed pair (src, dst): FIFO of posted sends and receives
    sendq: Dict[Tuple[int, int], list] = {}
    recvq: Dict[Tuple[int, int], list] = {}
    finish: Dict[Tuple[int, Action], float] = {}  # arrival time of each matched communication action

    def need(r, a, key, what):
        if key not in done[r]:
            raise ScheduleError(f"stage {r}: {a} runs before {what}")

    def match(src, dst):
        s, q = sendq.get((src, dst), []), recvq.get((src, dst), [])
        while s and q:
            (sa, st), (ra, rt) = s.pop(0), q.pop(0)
            fam_s, fam_r = sa.kind.split("_")[1], ra.kind.split("_")[1]
            if fam_s != fam_r or peer(sa, src, pp, vp) != (dst, ra.chunk) or sa.microbatch != ra.microbatch:
                raise ScheduleError(f"message mismatch: stage {src} {sa} is received by stage {dst} as {ra}")
            t = max(st, rt) + comm_time
            finish[(src, sa)] = finish[(dst, ra)] = t

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(prog[r]):
                step = prog[r][pos[r]]
                if isinstance(step, Action):
                    _compute(r, step, done, need, pp, vp, live, max_live)
                    cost = (fwd_time if step.kind == "fwd" else bwd_time) / vp
                    clock[r] += cost
                    busy[r] += cost
                else:
                    if not posted[r]:
                        posted[r] = True
                        for a in step:
                            p = peer(a, r, pp, vp)[0]
                            if a.kind.startswith("send"):
                                need(r, a, (a.kind[5:], a.microbatch, a.chunk), f"its {a.kind[5:]}")
                                sendq.setdefault((r, p), []).append((a, clock[r]))
                                match(r, p)
                            else:
                                recvq.setdefault((p, r), []).append((a, clock[r]))
                                match(p, r)
                    if not all((r, a) in finish for a in step):
                        break
                    clock[r] = max([clock[r]] + [finish[(r, a)] for a in step])
                    done[r].update((a.kind, a.microbatch, a.chunk) for a in step)
                    posted[r] = False
                pos[r] += 1
                progress = True
    stuck = [f"stage {r} waits at {prog[r][pos[r]]}" for r in range(pp) if pos[r] < len(prog[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    if m is not None:
        kinds = ("fwd",) if forward_only else ("fwd", "bwd")
        for r in range(pp):
            want = {(k, i, v) for k in kinds for i in range(m) for v in range(vp)}
            got = {d for d in done[r] if d[0] in COMPUTE}
            if got != want:
                raise ScheduleError(f"stage {r}: compute actions {sorted(got ^ want)} missing or extra")
    return SimResult(max_live, busy, max(clock) if clock else 0.0)


def _compute(r, a, done, need, pp, vp, live, max_live):
    key = (a.kind, a.microbatch, a.chunk)
    if key in done[r]:
        raise ScheduleError(f"stage {r}: {a} runs twice")
    if a.kind == "fwd":
        if not (r == 0 and a.chunk == 0):
            need(r, a, ("recv_fwd", a.microbatch, a.chunk), "its input arrives")
        live[r] += 1
        max_live[r] = max(max_live[r], live[r])
    else:
        need(r, a, ("fwd", a.microbatch, a.chunk), "its forward")
        if not (r == pp - 1 and a.chunk == vp - 1):
            need(r, a, ("recv_bwd", a.microbatch, a.chunk), "its output gradient arrives")
        live[r] -= 1
    done[r].add(key)
