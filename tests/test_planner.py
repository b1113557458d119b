"""The layout planner: enumeration, memory filter, step-time model, advice, JSON and flags."""
import json
import os
import subprocess
import sys

import pytest

import models
from megazero.config import parse_args
from megazero.memory import estimate_stages
from megazero.planner import (GB, GPUS, Hardware, Layout, Link, advice, enumerate_layouts, flags, layout_config,
                              model_config, peak_memory, plan, step_time)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plan.py")
MODEL = ["--num-layers", "8", "--hidden-size", "96", "--num-attention-heads", "6", "--vocab-size", "1000"]


def hw(memory_gb=80.0, per_node=8, overhead=0.0):
    tflops, _, intra, inter, hbm = GPUS["H100"]
    return Hardware(tflops * 1e12, 0.5, memory_gb * GB, Link(5e-6, 1 / (intra * GB)), Link(15e-6, 1 / (inter * GB)),
                    hbm * GB, per_node, overhead)


def base(seq=128, gbs=32, args=MODEL):
    return model_config(args, models.PRESETS, seq, gbs, fp32=False)


def test_enumeration_respects_divisibility():
    cfg = base()
    layouts = list(enumerate_layouts(cfg, 16, 8))
    assert layouts
    for x in layouts:
        assert x.tp * x.pp * x.dp == 16 and x.tp <= 8
        assert 6 % x.tp == 0 and 96 % x.tp == 0 and 8 % x.pp == 0
        assert 32 % (x.dp * x.micro_batch_size) == 0
        m = 32 // (x.dp * x.micro_batch_size)
        assert x.vpp == 1 or (x.pp > 1 and 8 % (x.pp * x.vpp) == 0 and m % x.pp == 0)
        assert not x.sequence_parallel or x.tp > 1
        assert x.zero_stage == 0 or x.dp > 1
    assert {x.tp for x in layouts} == {1, 2}  # 6 heads: TP 4 and 8 do not divide them
    assert {x.pp for x in layouts} == {1, 2, 4, 8}
    assert {x.recompute for x in layouts} == {"none", "selective", "full"}
    assert any(x.vpp > 1 for x in layouts) and any(x.sequence_parallel for x in layouts)


def test_flags_parse_and_reproduce_the_layout():
    cfg = base()
    for x in list(enumerate_layouts(cfg, 16, 8))[::7]:
        parsed = parse_args(flags(x, MODEL, cfg) + ["--mock-data"], presets=models.PRESETS, world_size=16)
        par = parsed.parallel
        assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size,
                par.virtual_pipeline_model_parallel_size, par.zero_stage, par.sequence_parallel) == \
            (x.tp, x.pp, x.dp, x.vpp, x.zero_stage, x.sequence_parallel)
        assert parsed.training.micro_batch_size == x.micro_batch_size and parsed.precision.bf16
        assert (parsed.model.recompute_granularity or "none") == x.recompute
        assert peak_memory(parsed) == peak_memory(layout_config(cfg, x, 16))


def test_memory_filter_and_order():
    cfg = base(seq=512, gbs=64)
    roomy = plan(cfg, 8, hw(80.0), margin=0.1)
    need = sorted(x.memory_bytes for x in roomy)
    budget_gb = need[len(need) // 2] / GB / 0.9  # half of the layouts fit this memory
    tight = plan(cfg, 8, hw(budget_gb), margin=0.1)
    assert 0 < len(tight) < len(roomy)
    assert all(x.memory_bytes <= 0.9 * budget_gb * GB for x in tight)
    times = [x.step["step_time_s"] for x in tight]
    assert times == sorted(times)
    for x in tight[:3]:
        lc = layout_config(cfg, x, 8)
        assert x.memory_bytes == max(r["total_bytes"] for r in estimate_stages(lc))


def test_step_time_terms_move_the_right_way():
    cfg = base(seq=256, gbs=64)
    h = hw()

    def t(**kw):
        x = Layout(**dict(dict(tp=1, pp=1, vpp=1, dp=8, zero_stage=0, recompute="none", sequence_parallel=False,
                               micro_batch_size=1), **kw))
        return step_time(layout_config(cfg, x, 8), h)

    assert t(recompute="full")["compute_s"] > t(recompute="selective")["compute_s"] > t()["compute_s"]
    assert t(tp=2, dp=4)["tp_comm_s"] > 0 == t()["tp_comm_s"]
    deep, interleaved = t(pp=4, dp=2), t(pp=4, dp=2, vpp=2)
    assert deep["bubble_s"] > interleaved["bubble_s"] > 0
    assert t(zero_stage=3)["dp_comm_s"] > t(zero_stage=0)["dp_comm_s"]
    slow = Hardware(h.peak_flops / 2, h.efficiency, h.memory_bytes, h.intra, h.inter, h.hbm_bytes_per_s, 8)
    x = Layout(1, 1, 1, 8, 0, "none", False, 1)
    assert step_time(layout_config(cfg, x, 8), slow)["compute_s"] == pytest.approx(2 * t()["compute_s"])


def test_nothing_fits_gives_the_smallest_change():
    cfg = base(seq=512, gbs=64)
    least = min(x.memory_bytes for x in plan(cfg, 8, hw(80.0), margin=0.0))
    tiny = hw(least / GB * 0.97)  # a little less than the leanest layout needs
    assert plan(cfg, 8, tiny, margin=0.0) == []
    msg = advice(cfg, 8, tiny, 0.0, {"micro_batch_sizes": None, "recompute": None, "zero_stages": None})
    assert "offload" in msg or "GPUs" in msg
    restricted = advice(cfg, 8, hw(80.0), 0.0, {"micro_batch_sizes": [16], "recompute": None,
                                                "zero_stages": None})
    assert "allow every micro-batch size" in restricted


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)


def test_plan_json_schema():
    res = _run("--json", "--gpus", "8", "--gpu-memory-gb", "24", "--global-batch-size", "32", "--seq-length", "128",
               *MODEL, "--top", "3")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    keys = {"tp", "pp", "vpp", "dp", "zero_stage", "recompute", "sequence_parallel", "micro_batch_size",
            "memory_gb", "step_time_s", "tokens_per_sec", "mfu", "flags"}
    assert data and all(keys <= set(d) for d in data)
    assert [d["step_time_s"] for d in data] == sorted(d["step_time_s"] for d in data)
    assert all(d["memory_gb"] <= 0.9 * 24 for d in data)
    first = data[0]
    cfg = parse_args(first["flags"].split() + ["--mock-data"], presets=models.PRESETS, world_size=8)
    assert cfg.parallel.tensor_model_parallel_size == first["tp"]
    assert first["tokens_per_sec"] == pytest.approx(32 * 128 / first["step_time_s"])


@pytest.mark.parametrize("args, flag", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "8", "--gpu", "X100"], "--gpu"),
    (["--gpus", "8", "--gpu-memory-gb", "-1"], "--gpu-memory-gb"),
    (["--gpus", "8", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["--gpus", "8", "--num-attention-heads", "0"], "--num-attention-heads"),
])
def test_bad_input_names_the_flag(args, flag):
    res = _run(*args, "--global-batch-size", "32", *([] if "--num-attention-heads" in args else MODEL))
    assert res.returncode == 2 and flag in res.stderr, res.stderr
