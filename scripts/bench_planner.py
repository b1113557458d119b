#!/usr/bin/env python
"""The planner's predicted step times against real pretrain_gpt.py runs (printed, never asserted).

Calibrates the link and compute constants on this machine (megazero.calibrate, 8 gloo ranks),
then for each layout of one small model runs ``pretrain_gpt.py`` under torchrun with 8 processes,
takes the median iteration time after warm-up from its metrics file, and prints it beside the
planner's prediction (megazero.planner.step_time) and the Spearman rank correlation.

    python scripts/bench_planner.py [--iters 6] [--calibration cal.json] [--nproc 8]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--vocab-size", "1024", "--global-batch-size", "16"]
LAYOUTS = {  # name: layout flags (8 ranks)
    "dp8 zero0 mb2": ["--micro-batch-size", "2"],
    "dp8 zero2 mb1": ["--micro-batch-size", "1", "--zero-stage", "2"],
    "tp2 dp4 zero1 mb2": ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--zero-stage", "1"],
    "tp2sp dp4 selective mb4": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--micro-batch-size", "4", "--recompute-granularity", "selective"],
    "tp4 dp2 full mb2": ["--tensor-model-parallel-size", "4", "--micro-batch-size", "2",
                         "--recompute-granularity", "full"],
    "pp2 dp4 mb1": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
    "pp2 vpp2 dp4 mb1": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                         "--micro-batch-size", "1"],
    "pp4 dp2 mb2": ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "2"],
    "tp2 pp2 dp2 zero3 mb1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--micro-batch-size", "1", "--zero-stage", "3"],
    "pp8 mb1": ["--pipeline-model-parallel-size", "8", "--micro-batch-size", "1"],
}


def spearman(xs, ys):
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def predict(flags, nproc, cal):
    from megazero.config import parse_args
    from megazero.planner import GB, Hardware, Link, step_time
    cfg = parse_args(MODEL + flags + ["--mock-data"], world_size=nproc)
    hw = Hardware(cal["flops"], 1.0, 64 * GB, Link(*cal["intra"]), Link(*cal["inter"]), 20 * GB, nproc,
                  cal.get("layer_overhead_s", 0.0))
    return step_time(cfg, hw)["step_time_s"]


def measure(flags, nproc, iters):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *MODEL, *flags, "--mock-data",
               "--train-iters", str(iters), "--metrics-file", metrics, "--log-interval", "1000"]
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=900)
        with open(metrics) as fh:
            times = [json.loads(line)["iteration_time"] for line in fh if line.strip()]
    return statistics.median(times[2:])  # the first iterations warm up


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--calibration", help="Use this calibration JSON instead of measuring one.")
    a = p.parse_args(argv)
    if a.calibration:
        with open(a.calibration) as fh:
            cal = json.load(fh)
    else:
        from megazero.calibrate import calibrate
        cal = calibrate(a.nproc)
    print(f"calibration: alpha {cal['intra'][0] * 1e3:.3f} ms, beta {cal['intra'][1] * 1e9:.3f} s/GB, "
          f"{cal['flops'] / 1e9:.2f} GFLOP/s per rank, {cal['layer_overhead_s'] * 1e3:.3f} ms per layer")
    print(f"{'layout':<28} {'predicted s':>12} {'measured s':>11} {'ratio':>7}")
    pred, meas = [], []
    for name, flags in LAYOUTS.items():
        pr, me = predict(flags, a.nproc, cal), measure(flags, a.nproc, a.iters)
        pred.append(pr)
        meas.append(me)
        print(f"{name:<28} {pr:>12.3f} {me:>11.3f} {pr / me:>7.2f}", flush=True)
    print(f"Spearman rank correlation (predicted vs measured): {spearman(pred, meas):.3f} over {len(pred)} layouts")


if __name__ == "__main__":
    main()
