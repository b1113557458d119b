"""The layout planner: enumeration, memory filter, step-time model, advice, JSON and flags."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

import models
from megazero.config import parse_args
from megazero.planning.estimate import estimate_rank, estimate_stages
from megazero.planning.planner import (GB, GPUS, Hardware, Layout, Link, enumerate_layouts, layout_config,
                                       peak_memory, plan, step_time)
from megazero.planning.report import advice, describe, flags, model_config

SAVED = models.saved_activations
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plan.py")
MODEL = ["--num-layers", "8", "--hidden-size", "96", "--num-attention-heads", "6", "--vocab-size", "1000"]


def hw(memory_gb=80.0, per_node=8, overhead=0.0):
    tflops, _, intra, inter, hbm = GPUS["H100"]
    return Hardware(tflops * 1e12, 0.5, memory_gb * GB, Link(5e-6, 1 / (intra * GB)),
                    Link(15e-6, 1 / (inter * GB)), hbm * GB, per_node, overhead)


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


def test_a_search_shares_model_states_and_agrees_with_each_layout_alone():
    """One search computes a stage's model state once for every micro-batch size; what it reports
    equals each layout's memory and step time computed on its own, without the shared states."""
    cfg, states = base(), {}
    found = plan(cfg, 16, hw(), saved=SAVED, states=states)
    assert len({x.micro_batch_size for x in found}) > 1
    assert 0 < len(states) < len(list(enumerate_layouts(cfg, 16, 8)))  # shared, not one per layout
    for x in found[::5]:
        lc = layout_config(cfg, x, 16)
        alone = step_time(lc, hw(), saved=SAVED)
        assert peak_memory(lc, saved=SAVED) == x.memory_bytes and alone == {k: x.step[k] for k in alone}


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
        assert peak_memory(parsed, saved=SAVED) == peak_memory(layout_config(cfg, x, 16), saved=SAVED)


def test_memory_filter_and_order():
    cfg = base(seq=512, gbs=64)
    roomy = plan(cfg, 8, hw(80.0), margin=0.1, saved=SAVED)
    need = sorted(x.memory_bytes for x in roomy)
    budget_gb = need[len(need) // 2] / GB / 0.9  # half of the layouts fit this memory
    tight = plan(cfg, 8, hw(budget_gb), margin=0.1, saved=SAVED)
    assert 0 < len(tight) < len(roomy)
    assert all(x.memory_bytes <= 0.9 * budget_gb * GB for x in tight)
    times = [x.step["step_time_s"] for x in tight]
    assert times == sorted(times)
    for x in tight[:3]:
        lc = layout_config(cfg, x, 8)
        assert x.memory_bytes == max(r["total_bytes"] for r in estimate_stages(lc, saved=SAVED))


def test_step_time_terms_move_the_right_way():
    cfg = base(seq=256, gbs=64)
    h = hw()

    def t(**kw):
        x = Layout(**dict(dict(tp=1, pp=1, vpp=1, dp=8, zero_stage=0, recompute="none",
                               sequence_parallel=False, micro_batch_size=1), **kw))
        return step_time(layout_config(cfg, x, 8), h, saved=SAVED)

    assert t(recompute="full")["compute_s"] > t(recompute="selective")["compute_s"] > t()["compute_s"]
    assert t(tp=2, dp=4)["tp_comm_s"] > 0 == t()["tp_comm_s"]
    deep, interleaved = t(pp=4, dp=2), t(pp=4, dp=2, vpp=2)
    assert deep["bubble_s"] > interleaved["bubble_s"] > 0
    assert t(zero_stage=3)["dp_comm_s"] > t(zero_stage=0)["dp_comm_s"]
    slow = Hardware(h.peak_flops / 2, h.efficiency, h.memory_bytes, h.intra, h.inter, h.hbm_bytes_per_s, 8)
    x = Layout(1, 1, 1, 8, 0, "none", False, 1)
    slowed = step_time(layout_config(cfg, x, 8), slow, saved=SAVED)
    assert slowed["compute_s"] == pytest.approx(2 * t()["compute_s"])


def test_ranks_sharing_processors_fill_the_bubble_and_overlap_nothing():
    """Ranks beyond the cores (8 CPU ranks on 2): a rank waiting in the pipeline bubble hands its
    processor to the others, and communication is CPU work that no backward hides."""
    cfg = base(seq=256, gbs=64)
    h = hw()
    shared = Hardware(h.peak_flops, h.efficiency, h.memory_bytes, h.intra, h.inter, h.hbm_bytes_per_s, 8,
                      oversubscription=4.0)

    def t(hardware, delay=True, **kw):
        x = Layout(**dict(dict(tp=1, pp=1, vpp=1, dp=8, zero_stage=0, recompute="none",
                               sequence_parallel=False, micro_batch_size=1), **kw))
        c = layout_config(cfg, x, 8)
        c.parallel.delay_wgrad_compute = delay
        return step_time(c, hardware, saved=SAVED)

    deep = t(shared, pp=4, dp=2)
    assert deep["bubble_s"] == 0 < t(h, pp=4, dp=2)["bubble_s"]
    # with few micro-batches the critical path still shows: pp 8 and 2 micro-batches (of 32) take
    # 2 + 7 slots, at a quarter of the processor each
    few = t(shared, delay=False, pp=8, dp=1, micro_batch_size=32)
    assert few["bubble_s"] == pytest.approx(few["compute_s"] * ((2 + 7) / 4 / 2 - 1))
    # --delay-wgrad-compute, a core per rank: each of the 7 bubble slots passes the gradient on
    # before the weight gradients, the forward's products with weights once more: over a quarter of
    # a slot's forward + backward here (most forward FLOPs are such products), at most a third
    whole, delayed = (t(h, delay=d, pp=8, dp=1, micro_batch_size=32) for d in (False, True))
    assert whole["bubble_s"] == pytest.approx(whole["compute_s"] * 7 / 2)
    saved = (whole["bubble_s"] - delayed["bubble_s"]) / (7 * whole["compute_s"] / 2)
    assert 0.25 < saved <= 1 / 3 + 1e-12
    assert delayed["compute_s"] == whole["compute_s"]
    # the whole reduction counts when nothing overlaps; at most all of it when it does
    assert t(shared, zero_stage=2)["dp_comm_s"] > t(h, zero_stage=2)["dp_comm_s"]


def test_calibration_fits_recover_the_constants():
    from megazero.planning.calibrate import fit_alpha_beta, fit_layer, layer_flops
    alpha, beta = 1.5e-3, 2e-10
    points = [(n, b, 2 * (n - 1) * (alpha + beta * b / n))
              for n in (2, 4, 8) for b in (65536, 524288, 2097152)]
    assert fit_alpha_beta(points) == pytest.approx((alpha, beta), rel=1e-9)
    rate, overhead = 1.2e10, 3e-3
    assert fit_layer({t: overhead + layer_flops(t) / rate for t in (256, 512, 1024)}) == \
        pytest.approx((rate, overhead), rel=1e-9)
    with pytest.raises(ValueError, match="quieter machine"):
        fit_layer({256: 0.02, 1024: 0.01})
    cal = {"flops": rate, "intra": [alpha, beta], "inter": [alpha, beta], "layer_overhead_s": overhead,
           "oversubscription": 4.0, "cores": 2, "core_flops": 8 * rate}
    machine = Hardware.from_calibration(cal, 64 * GB, 8)  # the calibrated machine: 8 ranks on 2 cores
    assert (machine.intra, machine.oversubscription, machine.layer_overhead_s) == \
        (Link(alpha, beta), 4.0, overhead)
    # a rank computes at the rate measured for it; a core's peak (8 x) shared by 4 ranks is its peak
    assert machine.peak_flops * machine.efficiency == pytest.approx(rate, rel=1e-12)
    assert (machine.peak_flops, machine.efficiency) == pytest.approx((2 * rate, 0.5), rel=1e-12)
    # 2 ranks on the same 2 cores: a core each, 4x the rate and a quarter of the fixed cost per layer
    pair = Hardware.from_calibration(cal, 64 * GB, 2)
    assert (pair.peak_flops * pair.efficiency, pair.oversubscription, pair.layer_overhead_s) == \
        pytest.approx((4 * rate, 1.0, overhead / 4), rel=1e-12)


def test_cpu_dropout_costs_its_masks_and_scores():
    """On a CPU host each dropped activation and attention score costs its calibrated seconds: two
    hidden dropouts of [s, b, h] per layer (split by SP) and b x heads x s x s scores (split by TP),
    drawn again under full recomputation; nothing without dropout, nothing on GPUs."""
    from megazero.planning.hardware import CPU_ATTENTION_DROPOUT_S, CPU_DROPOUT_S
    cal = {"flops": 1e10, "intra": [1e-5, 1e-10], "inter": [1e-5, 1e-10], "layer_overhead_s": 0.0,
           "oversubscription": 1.0, "cores": 8, "core_flops": 2e10, "dropout_s": 2e-9,
           "attention_dropout_s": 3e-9}
    cpu = Hardware.from_calibration(cal, 64 * GB, 8)
    assert Hardware.cpu_host(16, 8, 64 * GB).dropout_s == 2 * CPU_DROPOUT_S  # assumed, 2 ranks a core
    assert Hardware.cpu_host(8, 8, 64 * GB).attention_dropout_s == CPU_ATTENTION_DROPOUT_S

    def compute(hardware, dropout, **kw):
        cfg = base(seq=256, gbs=64)  # MODEL: 8 layers, hidden 96, 6 heads
        cfg.model.hidden_dropout = cfg.model.attention_dropout = dropout
        x = Layout(**dict(dict(tp=1, pp=1, vpp=1, dp=8, zero_stage=0, recompute="none",
                               sequence_parallel=False, micro_batch_size=2), **kw))
        c = layout_config(cfg, x, 8)
        return step_time(c, hardware, saved=SAVED)["compute_s"], c
    plain, c = compute(cpu, 0.0)
    dropped, _ = compute(cpu, 0.1)
    m, b, n_micro = c.model, 2, c.training.num_micro_batches
    per_layer = 2 * b * 256 * m.hidden_size * 2e-9 + b * m.num_attention_heads * 256 * 256 * 3e-9
    assert dropped - plain == pytest.approx(n_micro * m.num_layers * per_layer, rel=1e-9)
    # TP 2 with SP: half the heads' scores and half the activations on a rank
    sp_plain, _ = compute(cpu, 0.0, tp=2, dp=4, sequence_parallel=True)
    sp_dropped, c2 = compute(cpu, 0.1, tp=2, dp=4, sequence_parallel=True)
    n2 = c2.training.num_micro_batches
    assert sp_dropped - sp_plain == pytest.approx(n2 * m.num_layers * per_layer / 2, rel=1e-9)
    full_plain, _ = compute(cpu, 0.0, recompute="full")
    full_dropped, _ = compute(cpu, 0.1, recompute="full")
    assert full_dropped - full_plain == pytest.approx(1.5 * (dropped - plain), rel=1e-9)
    assert compute(hw(), 0.1)[0] == compute(hw(), 0.0)[0]  # a GPU: element-wise work, not counted here


def test_nothing_fits_gives_the_smallest_change():
    cfg = base(seq=512, gbs=64)
    least = min(x.memory_bytes for x in plan(cfg, 8, hw(80.0), margin=0.0, saved=SAVED))
    tiny = hw(least / GB * 0.97)  # a little less than the leanest layout needs
    assert plan(cfg, 8, tiny, margin=0.0, saved=SAVED) == []
    msg = advice(cfg, 8, tiny, 0.0, {"micro_batch_sizes": None, "recompute": None, "zero_stages": None},
                 saved=SAVED)
    assert "offload" in msg or "GPUs" in msg
    restricted = advice(cfg, 8, hw(80.0), 0.0, {"micro_batch_sizes": [16], "recompute": None,
                                                "zero_stages": None}, saved=SAVED)
    assert "allow every micro-batch size" in restricted


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)


def test_plan_json_schema():
    res = _run("--json", "--gpus", "8", "--gpu-memory-gb", "24", "--global-batch-size", "32",
               "--seq-length", "128", *MODEL, "--top", "3")
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
    (["--gpus", "8", "--decoder-first-pipeline-num-layers", "1"], "--decoder-first-pipeline-num-layers"),
    (["--gpus", "8", "--device", "cuda", "--host-cores", "2"], "--host-cores"),
    (["--gpus", "8", "--device", "cpu", "--gpu-memory-gb", "23"], "--gpu-memory-gb"),
    (["--gpus", "8", "--host-memory-gb", "0"], "--host-memory-gb"),
    (["--gpus", "8", "--offload-param-device", "cpu"], "--offload-param-device"),
])
def test_bad_input_names_the_flag(args, flag, capsys):
    from models.cli import plan_main  # in-process: the script itself is run by test_plan_json_schema
    model = [] if "--num-attention-heads" in args else MODEL
    code = plan_main([*args, "--global-batch-size", "32", *model])
    err = capsys.readouterr().err
    assert code == 2 and flag in err, err


def test_calibrate_measures_this_machine_and_bench_planner_repredicts(tmp_path):
    """``plan.py --calibrate`` on 2 gloo ranks gives usable constants; bench_planner.py re-predicts
    earlier measurements from them without running anything."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, SCRIPT, "--calibrate", "--calibrate-ranks", "2", "--calibrate-dir",
                          str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cal = json.loads(out.stdout)
    assert (cal["flops"] > 1e8 and cal["intra"][0] >= 0 and cal["intra"][1] > 0
            and cal["oversubscription"] >= 1)
    assert 1e6 < cal["disk_bytes_per_s"] < 1e12 and os.listdir(tmp_path) == []  # its swap file removed
    assert Hardware.from_calibration(cal, 1e9, 1).disk_bytes_per_s == cal["disk_bytes_per_s"]
    assert cal["cores"] >= 1 and cal["core_flops"] > 1e8
    # a mask per element costs something, and well under a millisecond (seconds per element)
    assert 1e-11 < cal["dropout_s"] < 1e-6 and 0 <= cal["attention_dropout_s"] < 1e-6
    assert Hardware.from_calibration(cal, 1e9, 1).dropout_s == pytest.approx(
        cal["dropout_s"] / max(1.0, cal["oversubscription"]), rel=1e-12)
    assert {n for n, _, _ in cal["allreduce_points"]} == {2}
    cal_path, measured = tmp_path / "cal.json", tmp_path / "measured.json"
    cal_path.write_text(json.dumps(cal))
    measured.write_text(json.dumps({"measured_s": {"dp8 zero0 mb2": 2.0, "tp8 mb4": 6.0,
                                                   "tp4 dp2 full mb2": 5.0}}))
    bench = os.path.join(ROOT, "scripts", "bench_planner.py")
    out = subprocess.run([sys.executable, bench, "--calibration", str(cal_path), "--measured", str(measured),
                          "--json", str(tmp_path / "out.json")], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result["predicted_s"]) == {"dp8 zero0 mb2", "tp8 mb4", "tp4 dp2 full mb2"}
    assert "over 3 layouts" in out.stdout


def test_context_parallel_proposed_when_nothing_fits_without_it():
    args = MODEL + ["--attention-dropout", "0"]  # dropout inside ring attention is not implemented
    cfg = base(seq=4096, gbs=8, args=args)
    few = dict(micro_batch_sizes=[1], recompute=("none",), zero_stages=(1,))  # a smaller search
    plain = plan(cfg, 8, hw(80.0), margin=0.0, saved=SAVED, **few)
    assert plain and all(x.cp == 1 for x in plain)  # it fits: no context parallelism proposed
    least = min(x.memory_bytes for x in plain)
    tight = plan(cfg, 8, hw(least / GB * 0.97), margin=0.0, saved=SAVED, **few)
    assert tight and all(x.cp > 1 for x in tight)
    best = tight[0]
    assert best.memory_bytes <= 0.97 * least and f"CP {best.cp}" in describe(best)
    parsed = parse_args(flags(best, args, cfg) + ["--mock-data"], presets=models.PRESETS, world_size=8)
    assert parsed.parallel.context_parallel_size == best.cp
    assert peak_memory(parsed, saved=SAVED) == best.memory_bytes


def test_nvme_tiers_add_their_bytes_at_the_disk_bandwidth():
    """The optimizer tier's reads and writes count whole; the parameters' only beyond the compute."""
    from megazero.planning.planner import estimate_rank_elements
    cfg = base(gbs=16)
    layout = Layout(tp=1, pp=1, vpp=1, dp=8, zero_stage=3, recompute="none", sequence_parallel=False,
                    micro_batch_size=1)
    mem = layout_config(cfg, layout, 8)
    assert mem.training.num_micro_batches == 2
    opt = mem.replace(parallel={"offload_optimizer_device": "nvme", "nvme_path": "/tmp"})
    both = mem.replace(parallel={"offload_optimizer_device": "nvme", "offload_param_device": "nvme",
                                 "nvme_path": "/tmp"})
    disk = dataclasses.replace(hw(), disk_bytes_per_s=8e8)  # 8 ranks on a node: 1e8 bytes/s each
    base_t = step_time(mem, disk, saved=SAVED)
    assert base_t["nvme_s"] == 0.0
    owned = estimate_rank_elements(mem, saved=SAVED)
    t_opt = step_time(opt, disk, saved=SAVED)
    # Adam: master + 2 moments in fp32, read and written once
    assert t_opt["nvme_s"] == pytest.approx(owned * 12 * 2 / 1e8, rel=1e-12)
    assert t_opt["step_time_s"] == pytest.approx(base_t["step_time_s"] + t_opt["nvme_s"], rel=1e-12)
    t_both = step_time(both, disk, saved=SAVED)
    params = owned * 2 * (2 * 2 + 1) / 1e8  # bf16, forward + backward per micro-batch, written once
    assert t_both["nvme_s"] == pytest.approx(t_opt["nvme_s"] + params - base_t["compute_s"], rel=1e-9)
    assert params > base_t["compute_s"]  # the case where the parameters' I/O outlasts the compute
    fast = dataclasses.replace(disk, disk_bytes_per_s=1e15)  # the parameters' I/O hidden: the optimizer's
    assert step_time(both, fast, saved=SAVED)["nvme_s"] == pytest.approx(owned * 24 / (1e15 / 8), rel=1e-12)


# ---- uneven pipeline stages, the attention kernel ---------------------------------------------
def test_pipeline_sizes_that_do_not_divide_the_layers_get_the_most_even_uneven_split():
    from megazero.pipeline.partition import balanced_split, stage_layer_counts
    assert [balanced_split(*a) for a in ((126, 16), (10, 4), (5, 2), (9, 8), (8, 4), (3, 4))] == \
        [(7, 7), (2, 2), (2, 3), (1, 2), None, None]
    args = ["--num-layers", "6"] + MODEL[2:]
    cfg = base(args=args)
    layouts = list(enumerate_layouts(cfg, 8, 8, recompute=("none",)))
    pp4 = [x for x in layouts if x.pp == 4]
    assert pp4 and all((x.first, x.last, x.vpp) == (1, 1, 1) for x in pp4)
    assert all(x.first is None for x in layouts if x.pp != 4) and {x.pp for x in layouts} == {1, 2, 4}
    x = next(x for x in pp4 if x.zero_stage == 0 and x.tp == 1 and x.micro_batch_size == 1)
    assert "PP 4 (first 1, last 1 layers)" in describe(x)
    parsed = parse_args(flags(x, args, cfg) + ["--mock-data"], presets=models.PRESETS, world_size=8)
    par = parsed.parallel
    assert stage_layer_counts(6, 4, par.decoder_first_pipeline_num_layers,
                              par.decoder_last_pipeline_num_layers) == [1, 2, 2, 1]
    # stage 1 holds the most (3 micro-batches in flight of 2 layers, against 4 of 1 on stage 0):
    # the memory filter takes every stage that can be the most loaded
    lc = layout_config(cfg, x, 8)
    stages = [estimate_rank(lc, r, saved=SAVED)["total_bytes"] for r in range(4)]
    assert stages.index(max(stages)) == 1 and peak_memory(lc, saved=SAVED) == max(stages)


@pytest.mark.slow
def test_attention_backend_unfused_keeps_the_scores_and_costs_time(capsys):
    """Megatron-LM's --attention-backend: unfused (and local) keep the s x s scores in the memory
    model and time them in the shape model; flash, fused and auto do neither."""
    from megazero.planning.activations import dims
    from megazero.planning.gpu_model import GPU_TYPES
    from models.cli import plan_main
    from models.saved_activations import core_bytes
    cfg = base(seq=512, gbs=8)
    lc = layout_config(cfg, Layout(1, 1, 1, 1, 0, "none", False, 1), 1)
    flash, unfused = (estimate_rank(lc, 0, saved=SAVED, attention=a)["activation_bytes"]
                      for a in ("flash", "unfused"))
    D = dims(lc, "cuda", "unfused")
    per_layer = core_bytes(D) - core_bytes(dims(lc, "cuda"))
    assert unfused - flash == 8 * per_layer  # one micro-batch in flight, 8 layers
    assert per_layer >= D.b * D.ap * D.s ** 2 * (2 * D.E + D.M)  # softmax, dropout mask and output
    a100 = GPU_TYPES["A100"]
    assert step_time(lc, Hardware.for_gpu(a100, attention="unfused"), saved=SAVED)["step_time_s"] > \
        step_time(lc, Hardware.for_gpu(a100), saved=SAVED)["step_time_s"]
    got = {}
    for backend in ("flash", "fused", "unfused", "local"):
        assert plan_main(["--gpus", "1", "--gpu", "A100", "--seq-length", "512", "--global-batch-size", "8",
                          "--micro-batch-sizes", "1", "--recompute", "none", "--json", *MODEL,
                          "--attention-backend", backend]) == 0
        (x,) = json.loads(capsys.readouterr().out)
        got[backend] = (x["memory_gb"], x["step_time_s"])
    assert got["flash"] == got["fused"] and got["unfused"] == got["local"]
    assert got["unfused"][0] > got["flash"][0] and got["unfused"][1] > got["flash"][1]
    assert got["unfused"][0] == pytest.approx(peak_memory(lc, saved=SAVED, attention="unfused") / GB,
                                              abs=1e-3)


# ---- CPU hosts: ranks share the host's memory, cores and disk ----------------------------------
XL_HOST = ["--gpus", "2", "--host-cores", "2", "--host-memory-gb", "23", "--host-disk-gb", "100",
           "--model", "gpt2-xl", "--seq-length", "256", "--global-batch-size", "2"]
TIERS = ["--offload-optimizer-device", "nvme", "--offload-param-device", "nvme",
         "--nvme-path", "/tmp/xl/swap"]


@pytest.mark.slow
def test_two_ranks_on_a_23_gb_host_share_it_and_plan_gpt2_xl_with_nvme_offload(capsys):
    """plan.py --gpus 2 on a 2-core, 23 GB host (injected; default: this machine's): the ranks share
    23 GB, which GPT-2 XL's fp32 Adam state (25 GB) does not fit without the disk."""
    from models.cli import plan_main
    assert plan_main(XL_HOST) == 1
    out = capsys.readouterr().out
    assert out.startswith("nothing fits 2 ranks sharing one host of 2 cores and 23 GB with a 10% margin; "
                          "smallest change: add --offload-optimizer-device nvme --nvme-path DIR"), out
    assert "of the host's 23 GB (2 ranks sharing it)" in out
    # 23 GB for each rank, as two GPUs would have, fits without offload: the defect this fixes
    assert plan_main(XL_HOST[:2] + ["--gpu-memory-gb", "23", "--fp32"] + XL_HOST[8:]) == 0
    capsys.readouterr()
    assert plan_main(XL_HOST + TIERS + ["--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and all(x["zero_stage"] == 3 and x["host_memory_gb"] <= 0.9 * 23 for x in found)
    for x in found:  # the host holds both ranks (PP 1: the same stage twice; PP 2: one of each)
        assert x["host_memory_gb"] >= (2 if x["pp"] == 1 else 1) * x["memory_gb"] - 2e-3
        assert x["mfu"] < 0.5 and x["breakdown"]["nvme_s"] > 0 and TIERS[1] in x["flags"]
    assert any(x["pp"] == 1 and x["dp"] == 2 for x in found)
    # the README's run: one process, ZeRO-3, both tiers on NVMe, full recomputation
    one = XL_HOST[2:] + TIERS + ["--gpus", "1", "--global-batch-size", "1", "--recompute", "full",
                                 "--json"]
    assert plan_main(one) == 0
    assert {(x["dp"], x["zero_stage"]) for x in json.loads(capsys.readouterr().out)} >= {(1, 3)}
    # a disk too small for the swap files is named
    assert plan_main(XL_HOST[:6] + ["--host-disk-gb", "10"] + XL_HOST[8:] + TIERS) == 1
    assert "GB of swap files on the host's disk, which has 10 GB free" in capsys.readouterr().out
    assert plan_main(XL_HOST[:6] + ["--host-disk-gb", "10"] + XL_HOST[8:]) == 1
    assert "(offloading the optimizer and the parameters to NVMe is not enough: its swap files need more " \
        "than the 10 GB free on the disk)" in capsys.readouterr().out


def test_ranks_on_a_host_share_its_cores_and_mfu_stays_below_a_layers_efficiency():
    """8 ranks on 2 cores do the work of 2 cores, not of 8; MFU is against the cores' peak."""
    from megazero.planning.hardware import CPU_EFFICIENCY
    cfg = model_config(MODEL, models.PRESETS, 256, 64, fp32=True)

    def t(ranks, cores):
        x = Layout(1, 1, 1, ranks, 0, "none", False, 1)
        return step_time(layout_config(cfg, x, ranks), Hardware.cpu_host(ranks, cores, 64 * GB), saved=SAVED)
    two, eight = t(2, 2), t(8, 2)
    assert eight["compute_s"] == pytest.approx(two["compute_s"], rel=1e-12)
    assert eight["step_time_s"] > two["step_time_s"]  # only the communication differs
    assert t(8, 8)["compute_s"] == pytest.approx(two["compute_s"] / 4, rel=1e-12)
    found = plan(cfg, 8, Hardware.cpu_host(8, 2, 64 * GB), saved=SAVED, micro_batch_sizes=(1,),
                 recompute=("none",), zero_stages=(0,))
    assert found and all(0 < x.step["mfu"] < CPU_EFFICIENCY for x in found)


def test_a_hosts_memory_holds_the_sum_of_its_ranks():
    from megazero.planning.planner import fits, host_memory
    cfg = model_config(MODEL, models.PRESETS, 128, 32, fp32=True)
    x = Layout(1, 2, 1, 2, 1, "none", False, 1)
    lc = layout_config(cfg, x, 4)
    need = [estimate_rank(lc, r, device="cpu", saved=SAVED) for r in range(2)]
    need = [int(e["total_bytes"] + e["host_bytes"]) for e in need]
    assert host_memory(lc, Hardware.cpu_host(4, 4, 1e12), saved=SAVED)[:2] == (max(need), 2 * sum(need))
    # two hosts of 2 ranks: each holds one stage's pair (ranks run tp-dp-pp)
    assert host_memory(lc, Hardware.cpu_host(2, 4, 1e12), saved=SAVED)[1] == 2 * max(need)
    x.memory_bytes, x.host_bytes = max(need), 2 * sum(need)
    assert not fits(x, Hardware.cpu_host(4, 4, 2 * sum(need) - 1), 2 * sum(need) - 1)
    assert fits(x, Hardware.cpu_host(4, 4, 2 * sum(need)), 2 * sum(need))


def test_a_calibration_without_the_cores_is_refused_with_the_fix(tmp_path, capsys):
    from models.cli import plan_main
    old = tmp_path / "cal.json"
    old.write_text(json.dumps({"flops": 1e10, "intra": [1e-4, 1e-9], "inter": [1e-4, 1e-9]}))
    assert plan_main(["--gpus", "2", "--calibration", str(old), "--global-batch-size", "8", *MODEL]) == 2
    assert "run plan.py --calibrate again" in capsys.readouterr().err
