"""The benchmark and GPU-check scripts on CPUs: arguments, test selection, smoke runs.

Timings are never asserted here (performance is measured by the scripts, against baselines in the
same run); what is checked is that the scripts run, select what they claim and that the peers of
``bench_peers.py`` compute what megazero computes (equal first-step losses).
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _run(cmd, **env):
    full = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHON=sys.executable, **env)
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900, cwd=ROOT)


def _commands(proc):
    return [line[2:].split() for line in proc.stdout.splitlines() if line.startswith("+ ")]


# ---- scripts/gpu_check.sh --------------------------------------------------------------------
def test_gpu_check_help_and_bad_arguments():
    proc = _run(["bash", GPU_CHECK, "--help"])
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "bench_gpu.py" in proc.stdout
    proc = _run(["bash", GPU_CHECK, "--bogus"])
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr
    proc = _run(["bash", GPU_CHECK, "--tests-only", "--bench-only"])
    assert proc.returncode == 2 and "exclude each other" in proc.stderr


@pytest.mark.parametrize("args,tests,bench", [
    ([], True, True), (["--tests-only"], True, False), (["--bench-only", "--quick"], False, True),
    (["--", "-k", "nccl", "-x"], True, True)])
def test_gpu_check_dry_run_selects_the_gpu_tests_and_the_benchmark(args, tests, bench):
    proc = _run(["bash", GPU_CHECK, "--dry-run", *args])
    assert proc.returncode == 0, proc.stderr
    cmds = _commands(proc)
    pytest_cmds = [c for c in cmds if c[1:3] == ["-m", "pytest"]]
    bench_cmds = [c for c in cmds if c[1:2] == ["scripts/bench_gpu.py"]]
    assert len(cmds) == tests + bench and len(pytest_cmds) == tests and len(bench_cmds) == bench
    for c in cmds:
        assert c[0] == sys.executable
    if tests:
        c = pytest_cmds[0]
        assert c[c.index("-m", 2) + 1] == "gpu" and "tests/test_gpu.py" in c
        if "--" in args:
            assert c[-3:] == ["-k", "nccl", "-x"]
    if bench:
        assert ("--quick" in bench_cmds[0]) == ("--quick" in args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_gpu_check_without_a_gpu_says_so():
    proc = _run(["bash", GPU_CHECK, "--tests-only"])
    assert proc.returncode == 3 and "no NVIDIA GPU" in proc.stderr


def test_the_gpu_marker_selects_exactly_tests_test_gpu():
    def collected(marker):
        proc = _run([sys.executable, "-m", "pytest", "--collect-only", "-q", "--strict-markers", "-m", marker,
                     "-p", "no:cacheprovider", "tests/test_gpu.py", "tests/test_mesh.py"])
        assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing collected
        return [line for line in proc.stdout.splitlines() if "::" in line]
    gpu, other = collected("gpu"), collected("not gpu")
    assert len(gpu) >= 10 and all(t.startswith("tests/test_gpu.py::") for t in gpu)
    assert other and not any(t.startswith("tests/test_gpu.py::") for t in other)


# ---- the benchmarks, smoke runs --------------------------------------------------------------
def test_bench_gpu_quick_runs_on_cpu():
    proc = _run([sys.executable, "scripts/bench_gpu.py", "--device", "cpu", "--quick", "--json", "-"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert set(out["results"]) == {"megazero", "megazero + full recompute", "transformers GPT2LMHeadModel"}
    rec, plain = out["results"]["megazero + full recompute"], out["results"]["megazero"]
    assert rec["loss"] == plain["loss"]  # the same model and batch: recomputation changes no arithmetic
    assert rec["hw_tflops"] / rec["model_tflops"] > 1.2  # recomputation's extra forward is counted


@pytest.mark.slow
@pytest.mark.skipif(torch.__version__ < "2.13",
                    reason="the torch-native peers are run on torch 2.13 only (on 2.6 the interleaved "
                    "pipelining peer lost a rank)")
def test_bench_peers_quick_runs_and_peers_compute_what_megazero_computes():
    proc = _run([sys.executable, "scripts/bench_peers.py", "--quick", "--layouts", "one", "dp2-zero1",
                 "tp2-sp", "pp2-interleaved", "--also-torch", "--json", "-"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout[proc.stdout.index("{"):])["rows"]
    assert [r["layout"] for r in rows] == ["one", "dp2-zero1", "tp2-sp", "pp2-interleaved"]
    for r in rows:
        assert r["megazero_ms"] > 0 and r["peer_ms"] > 0
        # same initial weights and samples: the first step's loss agrees to fp32 rounding
        assert r["first_loss"]["megazero"] == pytest.approx(r["first_loss"]["peer"], rel=1e-5), r["layout"]
        assert r["first_loss"]["megazero_torch"] == pytest.approx(r["first_loss"]["peer"], rel=1e-5)
        assert r["megazero_torch_ms"] > 0
        assert r["torch_ratio"] == pytest.approx(r["megazero_torch_ms"] / r["peer_ms"])
        assert r["megazero_mb"] <= r["formula_mb"] * 1.02  # padding only


@pytest.mark.slow
def test_bench_host_malloc_quick_runs_every_policy_in_its_own_process():
    proc = _run([sys.executable, "scripts/bench_host_malloc.py", "--quick", "--json", "-"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert [r["policy"] for r in out["rows"]] == ["keep", "release", "system"]
    for r in out["rows"]:
        assert r["ms"] > 0 and r["peak_mb"] > 0 and r["faults"] >= 0
        assert r["ratio"] == pytest.approx(r["ms"] / out["rows"][0]["ms"])
    assert _run([sys.executable, "scripts/bench_host_malloc.py", "--rounds", "0"]).returncode == 2


@pytest.mark.slow
def test_bench_moe_quick_runs_and_the_grouped_experts_equal_the_loop():
    proc = _run([sys.executable, "scripts/bench_moe.py", "--quick", "--json", "-"], PYTHONPATH=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    experts, ep = out["experts"], out["ep"]
    assert sum(experts["counts"]) == 256 and len(set(experts["counts"])) > 1  # uneven groups: padding runs
    assert experts["max_abs_diff"] < 1e-5  # the same products (fp32, sums of 32 and 48 terms)
    assert out["experts_balanced"]["counts"] == [32] * 8 and out["experts_balanced"]["max_abs_diff"] < 1e-5
    assert min(experts["loop"], experts["grouped"], ep["ep1"], ep["ep2"], ep["all_to_all"]) > 0
    assert "loop / grouped" in proc.stdout and "EP 2 / EP 1" in proc.stdout


@pytest.mark.slow  # a second: the script imports torch before it parses
def test_bench_moe_bad_sizes_exit_2():
    proc = _run([sys.executable, "scripts/bench_moe.py", "--ranks", "3"], PYTHONPATH=ROOT)
    assert proc.returncode == 2 and "--ranks" in proc.stderr


def test_bench_peers_times_the_trainers_own_step(monkeypatch):
    """megazero's side of bench_peers.py is megazero.training.loop._step, the step a user's run takes."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    from bench import peers
    import megazero.training.loop as loop
    calls, real = [], loop._step
    monkeypatch.setattr(loop, "_step", lambda *a, **k: (calls.append(a[5].iteration), real(*a, **k))[1])
    step = peers._megazero(peers.LAYOUTS["one"], peers.QUICK_MODEL)[0]
    first, second = step(), step()
    assert calls == [0, 1]  # the trainer's position advances: the next samples, as in training
    assert isinstance(first, float) and math.isfinite(first) and first != second


@pytest.mark.slow
def test_bench_matmul_times_the_models_products_and_says_what_auto_chooses():
    from megazero.tensor_parallel.layers import onednn_linear_available
    if not onednn_linear_available():
        pytest.skip("no oneDNN linear in this torch build")
    proc = _run([sys.executable, "scripts/bench_matmul.py", "--hidden-size", "128",
                 "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
                 "--num-layers", "2", "--vocab-size", "1024",
                 "--reps", "1", "--json", "-"], PYTHONPATH=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    shapes = {(r["out"], r["inp"]) for r in out["rows"]}
    assert shapes == {(384, 128), (128, 128), (512, 128), (128, 512), (1024, 128)}  # qkv proj fc1 fc2 head
    measured = [r for r in out["rows"] if r["measured"]]
    assert all(r["macs"] >= 1 << 23 for r in measured) and measured  # 128 rows x 1024 x 128 = 16.8M
    assert out["auto"] == ("onednn" if out["total"]["onednn"] <= 0.97 * out["total"]["torch"] else "torch")


@pytest.mark.slow
def test_bench_moe_deepspeed_times_megazeros_layer_and_names_a_missing_deepspeed(tmp_path):
    """DeepSpeed is not installed here: its side is refused in one line (exit 2); megazero's own side,
    both expert paths, runs as a child of the script."""
    proc = _run([sys.executable, "scripts/bench_moe_deepspeed.py", "--ds-python", str(tmp_path / "none")],
                PYTHONPATH=ROOT)
    assert proc.returncode == 2 and "--ds-python" in proc.stderr
    for side in ("megazero", "megazero_grouped"):
        proc = _run([sys.executable, "scripts/bench_moe_deepspeed.py", "--child", side, "--tokens", "64",
                     "--hidden", "32", "--ffn", "48", "--rounds", "1", "--warmup", "0"],
                    PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")]))
        assert proc.returncode == 0, proc.stderr[-3000:]
        seconds = json.loads(proc.stdout.split("MOE_RESULT ", 1)[1])["seconds"]
        assert seconds > 0


@pytest.mark.slow
def test_bench_documents_runs_both_kernels():
    proc = _run([sys.executable, "scripts/bench_documents.py", "--seq-length", "128", "--documents", "4",
                 "--hidden-size", "64", "--rounds", "1"], PYTHONPATH=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split()[:1] in (["sdpa"], ["blockwise"])]
    assert [r[0] for r in rows] == ["sdpa", "blockwise"] and all(float(r[3]) > 0 for r in rows)
