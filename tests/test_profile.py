"""--profile and its Megatron-LM companions: a parseable trace for the listed ranks and steps only."""
import collections
import io
import json
import math
import os

import pytest

from megazero.config import ConfigError, config_from_dict, validate
from megazero.process.local_ranks import run_ranks
from megazero.training.profiling import StepProfiler, startup_line, trace_path
from megazero.training.trace_lanes import separate_crossing_slices


def _cfg(tmp_path, **extra):
    settings = dict(mock_data=True, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                    vocab_size=64, global_batch_size=4, micro_batch_size=1, train_iters=4, log_interval=1,
                    hidden_dropout=0.0, attention_dropout=0.0, profile=True, profile_step_start=1,
                    profile_step_end=3, profile_ranks=[1], profile_dir=str(tmp_path / "traces"))
    return config_from_dict(dict(settings, **extra))


def _train(cfg):
    import models
    from megazero.training import train
    out = io.StringIO()
    train(cfg, models.build_chunks, stream=out)
    return out.getvalue()


def _ops(path):
    with open(path) as f:
        trace = json.load(f)
    return trace["traceEvents"]


def _perfetto_ns(us):
    """Perfetto's JSON importer: microseconds to integer nanoseconds, rounded half away from zero."""
    scaled = us * 1000.0
    return int(math.copysign(math.floor(abs(scaled) + 0.5), scaled))


def _dropped_by_perfetto(events):
    """The complete slices Perfetto's importer drops: on one (pid, tid) track, each slice must end
    inside every slice it starts in (checked on the importer's nanoseconds)."""
    tracks = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            start = _perfetto_ns(e["ts"])
            tracks[e["pid"], e["tid"]].append((start, start + _perfetto_ns(e.get("dur", 0)), e["name"]))
    dropped = []
    for slices in tracks.values():
        open_ = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            open_ = [o for o in open_ if o[1] > start]
            if any(end > o[1] for o in open_):
                dropped.append(name)
            else:
                open_.append((start, end, name))
    return dropped


@pytest.mark.slow
def test_profile_writes_a_trace_for_the_listed_ranks_and_steps_only(tmp_path):
    cfg = _cfg(tmp_path, pipeline_model_parallel_size=2)  # gloo point-to-point work in the trace
    out = run_ranks(_train, 2, cfg)
    files = sorted(os.listdir(tmp_path / "traces"))
    assert files == ["trace_rank1_iters2-3.json"]  # rank 0 is not listed
    expected = os.path.join(str(tmp_path / "traces"), "trace_rank<R>_iters2-3.json")
    assert f"torch.profiler trace of iterations 2-3 on ranks 1 -> {expected}" in out[0]
    events = _ops(tmp_path / "traces" / files[0])
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names)  # the step's operators are in it
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("iteration ")})
    assert steps == ["iteration 2", "iteration 3"]  # the window, marked step by step
    assert "gloo:send" in names and "gloo:recv" in names
    assert _dropped_by_perfetto(events) == []  # Perfetto shows every slice


def test_rank_0_prints_the_path_of_the_trace_it_wrote(tmp_path):
    out = run_ranks(_train, 1, _cfg(tmp_path, profile_ranks=[0]))[0]
    path = trace_path(_cfg(tmp_path).logging, 0)
    assert f"megazero: --profile: wrote {path} (open it in Perfetto" in out
    assert out.index(f"wrote {path}") > out.index("iteration 3/4")  # once the window is over
    assert os.path.exists(path)


def test_crossing_slices_move_to_a_track_of_their_own():
    """A gloo send launched inside c10d::send outlives it; Perfetto would drop it (and, after the
    importer's rounding to nanoseconds, a slice that ends 0.2 ns before its parent in microseconds)."""
    def x(name, ts, dur, tid=7):
        return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "main"}},
              x("iteration 1", 0.0, 100.0), x("c10d::send", 1.0, 3.0), x("gloo:send", 3.5, 60.0),
              x("aten::mm", 10.0, 5.0), x("aten::add", 20.0, 2.0004), x("inner", 21.0006, 0.9996),
              x("other thread", 0.0, 1000.0, tid=9),
              {"ph": "s", "name": "flow", "id": 3, "pid": 1, "tid": 7, "ts": 3.5},
              {"ph": "f", "name": "flow", "id": 4, "pid": 1, "tid": 7, "ts": 10.0}]
    trace = {"traceEvents": [dict(e) for e in events]}
    assert sorted(_dropped_by_perfetto(trace["traceEvents"])) == ["gloo:send", "inner"]
    assert separate_crossing_slices(trace) == 2
    out = trace["traceEvents"]
    assert _dropped_by_perfetto(out) == []
    assert [e["name"] for e in out if e["ph"] == "X"] == [e["name"] for e in events if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in out if e["ph"] == "X"] == \
        [(e["ts"], e["dur"]) for e in events if e["ph"] == "X"]  # no time changed
    tid = {e["name"]: e["tid"] for e in out if e["ph"] in ("X", "s", "f")}
    assert tid["gloo:send"] not in (7, 9) and tid["aten::mm"] == 7 and tid["other thread"] == 9
    assert [e["tid"] for e in out if e["ph"] in ("s", "f")] == [tid["gloo:send"], 7]  # the arrow follows
    lanes = {e["tid"]: e["args"]["name"] for e in out if e["ph"] == "M"}
    assert lanes[tid["gloo:send"]] == "main (overlapping 1)"
    assert tid["inner"] == tid["gloo:send"]  # packed onto the same extra track: it fits there


def test_profiler_window_counts_as_megatron_does(tmp_path, monkeypatch):
    """Started when S iterations are done, stopped when E are; a trace is written once."""
    lg = _cfg(tmp_path, profile_step_start=2, profile_step_end=4, profile_ranks=[0]).logging
    import torch
    events = []

    class FakeProfile:
        def __init__(self, **kw):
            events.append(("new", kw["record_shapes"]))

        def __enter__(self):
            events.append("start")

        def __exit__(self, *exc):
            events.append("stop")

        def export_chrome_trace(self, path):
            events.append("export")
            open(path, "w").write('{"traceEvents": []}')

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    prof = StepProfiler(lg, 0, torch.device("cpu"))
    seen = []
    for it in range(1, 7):
        prof.before(it)
        seen.append((it, prof._running is not None))
        prof.after(it)
    prof.close()
    assert [it for it, on in seen if on] == [3, 4]
    assert events == [("new", True), "start", "stop", "export"]
    assert os.path.exists(trace_path(lg, 0))
    other = StepProfiler(lg, 1, torch.device("cpu"))  # not a listed rank
    for it in range(1, 7):
        other.before(it)
        assert other._running is None


@pytest.mark.slow
def test_a_run_stopped_inside_the_window_writes_its_trace(tmp_path, monkeypatch):
    lg = _cfg(tmp_path, profile_step_start=0, profile_step_end=5, profile_ranks=[0]).logging
    import torch
    prof = StepProfiler(lg, 0, torch.device("cpu"))
    prof.before(1)
    torch.ones(3).add(1)
    prof.after(1)
    prof.close()  # the loop ended early (a signal): the part profiled is written
    assert any(e.get("name") == "aten::add" for e in _ops(trace_path(lg, 0)))


@pytest.mark.parametrize("changes,needle", [
    (dict(profile_step_start=3, profile_step_end=3), "--profile-step-start 3 --profile-step-end 3"),
    (dict(profile_step_start=-1), "--profile-step-start -1"),
    (dict(profile_ranks=[2]), "--profile-ranks 2: give global ranks from 0 to 1"),
])
def test_bad_profile_flags_name_the_flag(tmp_path, changes, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(_cfg(tmp_path, **changes), 2)
    validate(_cfg(tmp_path, **changes, profile=False), 2)  # ignored without --profile


def test_startup_line_says_when_there_is_nothing_to_profile(tmp_path):
    import torch
    lg = _cfg(tmp_path, profile_step_start=5, profile_step_end=6).logging
    assert "nothing to profile" in startup_line(lg, torch.device("cpu"), 4)
    assert "capture range" in startup_line(lg, torch.device("cuda"), 10)
    assert startup_line(_cfg(tmp_path, profile=False).logging, torch.device("cpu"), 4) is None
