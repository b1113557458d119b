"""Pipeline schedules as data, checked by the pure simulator (no process group)."""
import pytest

from megazero.pipeline.partition import stage_layers
from megazero.pipeline.schedules import (Action, ScheduleError, bubble_fraction, build_schedule, gpipe,
                                         interleaved_one_f_one_b, interleaved_warmup, one_f_one_b, simulate,
                                         steps)

CASES = [(pp, m) for pp in (1, 2, 4) for m in sorted({1, pp, 2 * pp + 1})]


def _compute(actions):
    return [(a.kind, a.microbatch, a.chunk) for a in actions if a.kind in ("fwd", "bwd")]


@pytest.mark.parametrize("pp,m", CASES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flat_schedules(pp, m, name):
    sched = build_schedule(name, pp, m)
    res = simulate(sched, m=m)  # raises on deadlock, mismatched messages, bwd before fwd, missing work
    want_live = [m] * pp if name == "gpipe" else [min(pp - r, m) for r in range(pp)]
    assert res.max_live == want_live
    # with F = 1, B = 2 and free messages both schedules idle exactly (p - 1) / (m + p - 1)
    assert res.bubble() == pytest.approx([bubble_fraction(pp, m)] * pp)
    assert res.makespan == pytest.approx(3 * (m + pp - 1))
    for r, acts in enumerate(sched):
        comp = _compute(acts)
        if name == "1f1b":
            warm = min(pp - r - 1, m)
            first_bwd = next(i for i, c in enumerate(comp) if c[0] == "bwd")
            assert first_bwd == warm + 1 or (warm == m and first_bwd == m)
        else:
            assert comp == [("fwd", i, 0) for i in range(m)] + [("bwd", i, 0) for i in range(m)]
        kinds = {a.kind for a in acts}
        assert ("recv_fwd" in kinds) == (r > 0) and ("send_bwd" in kinds) == (r > 0)
        assert ("send_fwd" in kinds) == (r < pp - 1) and ("recv_bwd" in kinds) == (r < pp - 1)


@pytest.mark.parametrize("pp,m", CASES)
@pytest.mark.parametrize("vp", [1, 2])
def test_interleaved(pp, m, vp):
    if m % pp:
        with pytest.raises(ScheduleError, match=rf"multiple of the pipeline-parallel size {pp}, got {m}; "
                                                rf"allowed counts: {pp}, {2 * pp}, {3 * pp}"):
            interleaved_one_f_one_b(pp, m, vp)
        return
    sched = interleaved_one_f_one_b(pp, m, vp)
    res = simulate(sched, vp=vp, m=m)
    # Megatron's bound: warm-up forwards + 1 chunk activations alive, at most all of them
    assert res.max_live == [min(interleaved_warmup(pp, r, m, vp) + 1, m * vp) for r in range(pp)]
    assert res.bubble() == pytest.approx([bubble_fraction(pp, m, vp)] * pp)
    for acts in sched:  # Megatron's order: groups of pp micro-batches per chunk
        fwd = [(a.microbatch, a.chunk) for a in acts if a.kind == "fwd"]
        assert fwd[:pp * vp] == [(i % pp + 0, i // pp) for i in range(pp * vp)][:len(fwd)]


@pytest.mark.parametrize("pp,m", CASES)
@pytest.mark.parametrize("name,vp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_forward_only(pp, m, name, vp):
    sched = build_schedule(name, pp, m, vp, forward_only=True)
    simulate(sched, vp=vp, m=m, forward_only=True)
    assert all(a.kind in ("fwd", "recv_fwd", "send_fwd") for acts in sched for a in acts)


def test_interleaved_beats_1f1b_bubble():
    flat = simulate(one_f_one_b(4, 8), m=8).bubble()[0]
    inter = simulate(interleaved_one_f_one_b(4, 8, 2), vp=2, m=8).bubble()[0]
    assert inter < flat
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


def test_1f1b_steady_state_fuses_send_and_receive():
    # stage 0 of pp 2: after its steady forward it sends the activation and receives the gradient
    groups = [s for s in steps(one_f_one_b(2, 3)[0]) if isinstance(s, tuple)]
    assert (Action("send_fwd", 1, 0), Action("recv_bwd", 0, 0)) in groups
    groups1 = [s for s in steps(one_f_one_b(2, 3)[1]) if isinstance(s, tuple)]
    assert (Action("send_bwd", 0, 0), Action("recv_fwd", 1, 0)) in groups1


def test_steps_grouping():
    acts = [Action("recv_fwd", 0), Action("fwd", 0), Action("send_fwd", 0), Action("recv_bwd", 0),
            Action("bwd", 0)]
    assert steps(acts) == [(acts[0],), acts[1], (acts[2], acts[3]), acts[4]]
    with pytest.raises(ScheduleError, match="unknown action kind 'jump'"):
        steps([Action("jump", 0)])


def test_simulator_catches_deadlock():
    s0 = [Action("fwd", 0), Action("send_fwd", 0), Action("fwd", 1), Action("send_fwd", 1),
          Action("recv_bwd", 0), Action("bwd", 0), Action("recv_bwd", 1), Action("bwd", 1)]
    s1 = [Action("recv_fwd", 0), Action("fwd", 0), Action("bwd", 0), Action("send_bwd", 0),
          Action("recv_fwd", 1), Action("fwd", 1), Action("bwd", 1), Action("send_bwd", 1)]
    simulate([s0, s1], m=2)
    bad0 = s0[:4] + [Action("recv_bwd", 1)] + s0[5:6] + [Action("recv_bwd", 0)] + s0[7:]
    with pytest.raises(ScheduleError, match="mismatch"):
        simulate([bad0, s1], m=2)
    # each stage waits for a receive that the other posts only after its own receive: deadlock
    d0 = [Action("fwd", 0), Action("send_fwd", 0), Action("fwd", 1), Action("recv_bwd", 0), Action("bwd", 0),
          Action("send_fwd", 1), Action("recv_bwd", 1), Action("bwd", 1)]
    d1 = [Action("recv_fwd", 0), Action("fwd", 0), Action("bwd", 0), Action("recv_fwd", 1), Action("fwd", 1),
          Action("send_bwd", 0), Action("bwd", 1), Action("send_bwd", 1)]
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits at \(recv_bwd\(0,0\),\); "
                                            r"stage 1 waits at \(recv_fwd\(1,0\),\)"):
        simulate([d0, d1], m=2)


def test_simulator_catches_order_and_missing_work():
    with pytest.raises(ScheduleError, match=r"bwd\(0,0\) runs before its forward"):
        simulate([[Action("bwd", 0), Action("fwd", 0)]], m=1)
    with pytest.raises(ScheduleError, match="missing or extra"):
        simulate([[Action("fwd", 0), Action("bwd", 0)]], m=2)
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate([[Action("fwd", 0), Action("fwd", 0)]])


def test_schedule_errors():
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'zb'"):
        build_schedule("zb", 2, 2)
    with pytest.raises(ScheduleError, match="use the interleaved schedule for virtual stages"):
        build_schedule("1f1b", 2, 2, vp=2)
    with pytest.raises(ScheduleError, match="number of micro-batches must be a positive integer"):
        gpipe(2, 0)


def test_partition_errors():
    assert stage_layers(6, 4, 0, first=3) == [range(0, 3)]
    assert [stage_layers(8, 4, r, first=1, last=3)[0] for r in range(4)] == \
        [range(0, 1), range(1, 3), range(3, 5), range(5, 8)]
    assert stage_layers(8, 2, 1, vp_layers=2) == [range(2, 4), range(6, 8)]
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by "
                                         "--pipeline-model-parallel-size 4"):
        stage_layers(6, 4, 0)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 4 is larger than --num-layers 3"):
        stage_layers(3, 4, 0)
    with pytest.raises(ValueError, match="cannot split 8 layers over 4 stages with first=2, last=3"):
        stage_layers(8, 4, 0, first=2, last=3)
