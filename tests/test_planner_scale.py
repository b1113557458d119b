"""The planner at cluster scale: compute by shape, published runs, launch scripts, bad input."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

import models
from megazero.planning import gpu_model
from megazero.planning.gpu_model import GPU_TYPES, gemm_seconds
from megazero.planning.planner import Hardware, plan
from megazero.planning.report import flags, model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench import published  # noqa: E402

from models.cli.launch_script import launch_script, script_flags  # noqa: E402


def _rate(m, n, k, gpu):
    return 2 * m * n * k / gemm_seconds(m, n, k, gpu)


def test_gemm_efficiency_rises_with_the_dimensions_below_its_ceiling():
    a100 = GPU_TYPES["A100"]
    peak = a100.peak_tflops * 1e12
    narrow, wide = _rate(4096, 2304, 2304, a100), _rate(4096, 25600, 3200, a100)
    tiny = _rate(64, 64, 64, a100)
    assert tiny < narrow < wide < a100.gemm_max * peak
    # far above the roofline's ridge the ceiling is approached; at the knee it is halved
    assert _rate(1 << 16, 1 << 16, 1 << 16, a100) > 0.99 * a100.gemm_max * peak
    balance = peak / (a100.hbm_gbs * 1e9)
    n = 3 * gpu_model.KNEE * balance  # the intensity of an n x n x n bf16 GEMM is n / 3
    assert _rate(n, n, n, a100) == pytest.approx(0.5 * a100.gemm_max * peak, rel=1e-9)


def test_wider_models_gain_per_gpu_at_constant_tensor_parallelism():
    """The weak-scaling trend: the same TP 8, a wider layer, more FLOP/s per GPU."""
    def rate(hidden):
        cfg = model_config(["--num-layers", "8", "--hidden-size", str(hidden), "--num-attention-heads",
                            str(hidden // 128)], models.PRESETS, 2048, 64, fp32=False)
        cfg = cfg.replace(parallel={"tensor_model_parallel_size": 8})
        t = gpu_model.micro_batch_seconds(cfg, GPU_TYPES["A100"], attention="unfused")
        return 8 * 24 * 2048 * hidden ** 2 / t["compute"]
    rates = [rate(h) for h in (4096, 8192, 16384, 25600)]
    assert rates == sorted(rates) and rates[-1] > 1.05 * rates[0]


@pytest.mark.slow
def test_published_runs_within_15_percent_with_their_trend():
    t = published.table()
    used = [x for x in t["rows"] if x["run"].used]
    assert len({x["run"].source for x in used}) >= 3
    assert any(not x["run"].fit for x in used) and any(x["run"].fit for x in used)
    for x in used:
        assert abs(x["error"]) <= 0.15, (x["run"].name, x["error"])
    trends = {src: v["spearman"] for src, v in t["sources"].items() if v["sizes"] >= 3}
    assert len(trends) >= 2 and all(rho >= 0.6 for rho in trends.values()), trends
    # a broken model is caught: half the GEMM ceiling moves every A100 row far out of the band
    slow = {**GPU_TYPES, "A100": replace(GPU_TYPES["A100"], gemm_max=0.4)}
    assert published.predict(published.RUNS[0], slow) < 0.7 * published.RUNS[0].reported


@pytest.mark.slow
def test_stored_constants_are_the_least_squares_fit():
    """bench_planner.py --published --fit reproduces the stored constants: nudging any of them
    makes the fit rows' error larger."""
    rows = [r for r in published.RUNS if r.fit]
    best = published.log_error(rows, GPU_TYPES, gpu_model.KNEE)
    for knee in (gpu_model.KNEE / 1.3, gpu_model.KNEE * 1.3):
        assert published.log_error(rows, GPU_TYPES, knee) > best
    for name in ("A100", "H100"):
        for step in (-0.02, 0.02):
            nudged = {**GPU_TYPES, name: replace(GPU_TYPES[name], gemm_max=GPU_TYPES[name].gemm_max + step)}
            assert published.log_error(rows, nudged, gpu_model.KNEE) > best, (name, step)


PLANS = [  # model flags, GPUs, GPU type, global batch
    (["--model", "gpt2-xl"], 16, "H100", 64),
    (["--model", "llama2-7b", "--seq-length", "2048"], 16, "A100", 64),
    (["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--vocab-size", "50257"],
     8, "L4", 32),
]


@pytest.mark.slow
@pytest.mark.parametrize("model_args, gpus, gpu, gbs", PLANS)
def test_emitted_launch_scripts_pass_pretrain_validation(model_args, gpus, gpu, gbs, tmp_path, monkeypatch,
                                                         capsys):
    from models.cli.pretrain import main as pretrain_main
    cfg = model_config(model_args, models.PRESETS, None, gbs, fp32=False)
    # restricted, so that the three plans take seconds: the top 5 of each is what is checked
    found = plan(cfg, gpus, Hardware.for_gpu(GPU_TYPES[gpu]), saved=models.saved_activations,
                 micro_batch_sizes=(1, 2), recompute=("none", "selective"))
    assert len(found) >= 5
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    for i, layout in enumerate(found[:5]):
        for kind in ("slurm", "torchrun"):
            text = launch_script(kind, flags(layout, model_args, cfg), gpus, 8, "test")
            path = tmp_path / f"{i}-{kind}.sh"
            path.write_text(text)
            assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
            assert ("#SBATCH --nodes=" in text) == (kind == "slurm")
            argv = script_flags(text)
            assert argv == flags(layout, model_args, cfg)
            assert pretrain_main(["--dry-run", *argv, "--mock-data"], presets=models.PRESETS) == 0, \
                capsys.readouterr()
            assert f"valid for {gpus} ranks: tp {layout.tp} pp {layout.pp}" in capsys.readouterr().out


def test_a_bad_emit_or_gpu_names_the_flag(capsys):
    from models.cli import plan_main
    small = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--global-batch-size", "8"]
    assert plan_main(["--gpus", "8", "--gpu", "X100", *small]) == 2
    assert "--gpu X100: unknown GPU type; choose one of A100, H100" in capsys.readouterr().err
    assert plan_main(["--gpus", "8", "--emit-path", "x.sh", *small]) == 2
    assert "--emit-path goes with --emit-launch" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_too_big_even_with_offload_says_what_to_change(capsys):
    from models.cli import plan_main
    big = ["--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32",
           "--seq-length", "1024", "--global-batch-size", "8"]
    assert plan_main(["--gpus", "2", "--gpu-memory-gb", "2", *big]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("nothing fits 2 GPUs of 2 GB")
    assert "GPUs with at least" in out
    assert "or more than 32 GPUs (offloading the optimizer and the parameters to NVMe is not enough)" in out


@pytest.mark.slow
def test_a_model_that_fits_only_with_nvme_offload_is_told_so_and_plan_py_plans_with_it(monkeypatch, capsys):
    from megazero.planning.report import advice
    from models.cli import plan_main
    from models.cli.pretrain import main as pretrain_main
    args = ["--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32"]
    cfg = model_config(args, models.PRESETS, 1024, 8, fp32=False)
    hw = Hardware.for_gpu(GPU_TYPES["H100"], memory_gb=10)
    assert plan(cfg, 2, hw, saved=models.saved_activations, recompute=("full",)) == []
    msg = advice(cfg, 2, hw, 0.1, {"micro_batch_sizes": None, "recompute": None, "zero_stages": None},
                 saved=models.saved_activations)
    assert msg.startswith("only with ZeRO-Infinity offload: add --offload-optimizer-device nvme "
                          "--offload-param-device nvme --nvme-path DIR"), msg
    # the flags it names (and docs/planning.md passes) are accepted, and every layout holds them
    tiers = ["--offload-optimizer-device", "nvme", "--offload-param-device", "nvme",
             "--nvme-path", "/scratch"]
    assert plan_main(["--gpus", "2", "--gpu-memory-gb", "10", "--seq-length", "1024",
                      "--global-batch-size", "8", "--json", *args, *tiers]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found and all(x["zero_stage"] == 3 and x["memory_gb"] <= 0.9 * 10 for x in found)
    assert all(x["breakdown"]["nvme_s"] > 0 for x in found)
    argv = found[0]["flags"].split()
    i = argv.index("--offload-optimizer-device")
    assert argv[i:i + 6] == tiers and argv.count("--nvme-path") == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain_main(["--dry-run", *argv, "--mock-data"], presets=models.PRESETS) == 0


@pytest.mark.slow
def test_llama3_405b_fits_its_published_layout_with_the_recomputation_its_memory_needs(monkeypatch, capsys):
    """Llama 3 405B (Grattafiori et al. 2024): 126 layers on TP 8 x PP 16 (7 layers on the first and
    the last stage, 8 on the others) x DP 128 = 16,384 H100s, sequence 8192, global batch 2048.
    The planner fits that layout; for megazero's layers (which keep about 1.7 GB per layer and
    micro-batch here) only with full recomputation: without it the most loaded rank needs more than
    an H100 holds (docs/planning.md)."""
    from megazero.planning.planner import Layout, layout_config, peak_memory
    from models.cli.pretrain import main as pretrain_main
    args = ["--num-layers", "126", "--hidden-size", "16384", "--num-attention-heads", "128",
            "--vocab-size", "128256", "--make-vocab-size-divisible-by", "128",
            "--max-position-embeddings", "8192",
            *[a for a in published.LLAMA3 if a != "--use-distributed-optimizer"]]
    cfg = model_config(args, models.PRESETS, 8192, 2048, fp32=False)
    found = plan(cfg, 16384, Hardware.for_gpu(GPU_TYPES["H100"]), saved=models.saved_activations,
                 micro_batch_sizes=(1,), zero_stages=(1,))  # restricted to keep it quick
    ours = [x for x in found
            if (x.tp, x.pp, x.dp, x.first, x.last, x.sequence_parallel) == (8, 16, 128, 7, 7, True)]
    assert ours and {x.recompute for x in ours} == {"full"}
    assert found[0] in ours  # and it is the fastest that fits
    bare = layout_config(cfg, Layout(8, 16, 1, 128, 1, "none", True, 1, first=7, last=7), 16384)
    assert peak_memory(bare, saved=models.saved_activations) > 80e9
    monkeypatch.setenv("WORLD_SIZE", "16384")
    argv = flags(ours[0], args, cfg)
    assert pretrain_main(["--dry-run", *argv, "--mock-data"], presets=models.PRESETS) == 0
    assert "valid for 16384 ranks: tp 8 pp 16" in capsys.readouterr().out


def test_a_sliding_window_shortens_flash_attention_time_by_the_keys_it_hides():
    """A 4096-token sequence whose queries see 512 keys: the flash attention time (forward and backward)
    shrinks by the ratio of keys seen, (w + 1 - (w + 1) w / 2s) / (s / 2) per windowed layer, mixed
    over the layers as Gemma 2 alternates them; the unfused kernel computes every score anyway."""
    s, w = 4096, 511

    def cfg_of(*window):
        return model_config(["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16",
                             *window], models.PRESETS, s, 1, fp32=False)

    h100 = GPU_TYPES["H100"]
    faster = replace(h100, attn_eff=2 * h100.attn_eff)

    def attention(cfg):  # the flash attention share of the compute: what doubling attn_eff halves
        slow, fast = (gpu_model.micro_batch_seconds(cfg, g)["compute"] for g in (h100, faster))
        return 2 * (slow - fast)

    def unfused(cfg):
        return gpu_model.micro_batch_seconds(cfg, h100, attention="unfused")["compute"]

    full, local = cfg_of(), cfg_of("--window-size", f"{w},0")
    alternating = cfg_of("--window-size", f"{w},0", "--window-attn-skip-freq", "2")
    keys = (w + 1) - (w + 1) * w / (2 * s)
    assert gpu_model.causal_keys(s, w) == pytest.approx(sum(min(i + 1, w + 1) for i in range(s)) / s)
    assert gpu_model.causal_keys(s, None) == s / 2 == gpu_model.causal_keys(s, s)  # no key hidden
    assert attention(full) > 0
    assert attention(local) == pytest.approx(attention(full) * keys / (s / 2), rel=1e-9)
    assert attention(alternating) == pytest.approx(attention(full) * (keys + s / 2) / s, rel=1e-9)
    assert unfused(local) == pytest.approx(unfused(full), rel=1e-12)
