#!/usr/bin/env python
"""The planner's predicted step times against real pretrain_gpt.py runs (printed, never asserted).

Calibrates the link and compute constants on this machine (megazero.planning.calibrate, 8 gloo ranks),
then for each layout of one small model runs ``pretrain_gpt.py`` under torchrun with 8 processes,
takes the median iteration time after warm-up from its metrics file, and prints it beside the
planner's prediction (megazero.planning.planner.step_time) and the Spearman rank correlation.

    python scripts/bench_planner.py [--iters 8] [--passes 2] [--calibration cal.json] [--json out.json]
    python scripts/bench_planner.py --calibration cal.json --measured out.json   # re-predict only

``--published`` instead prints published large runs beside the planner's prediction for their
layouts (bench/published.py names the sources); ``--fit`` refits the GPU constants on the rows
marked for fitting first and prints the fitted values.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.published import report, spearman


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--vocab-size", "1024", "--global-batch-size", "16"]
LAYOUTS = {  # name: layout flags (8 ranks)
    "dp8 zero0 mb2": ["--micro-batch-size", "2"],
    "dp8 zero2 mb1": ["--micro-batch-size", "1", "--zero-stage", "2"],
    "tp2 dp4 zero1 mb2": ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                          "--zero-stage", "1"],
    "tp2sp dp4 selective mb4": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--micro-batch-size", "4", "--recompute-granularity", "selective"],
    "tp4 dp2 full mb2": ["--tensor-model-parallel-size", "4", "--micro-batch-size", "2",
                         "--recompute-granularity", "full"],
    "pp2 dp4 mb1": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
    "pp2 vpp2 dp4 mb1": ["--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1"],
    "pp4 dp2 mb2": ["--pipeline-model-parallel-size", "4", "--micro-batch-size", "2"],
    "tp2 pp2 dp2 zero3 mb1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--micro-batch-size", "1", "--zero-stage", "3"],
    "pp8 mb1": ["--pipeline-model-parallel-size", "8", "--micro-batch-size", "1"],
    "tp2 pp2 dp2 zero1 mb1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--micro-batch-size", "1", "--zero-stage", "1"],
    "dp8 zero3 mb2": ["--micro-batch-size", "2", "--zero-stage", "3"],
    "tp8 mb4": ["--tensor-model-parallel-size", "8", "--micro-batch-size", "4"],
    "tp2 dp4 full mb1": ["--tensor-model-parallel-size", "2", "--micro-batch-size", "1",
                         "--recompute-granularity", "full"],
}


def predict(flags, nproc, cal):
    from megazero.config import parse_args
    from megazero.planning.planner import GB, Hardware, step_time
    cfg = parse_args(MODEL + flags + ["--mock-data"], world_size=nproc)
    hw = Hardware.from_calibration(cal, 64 * GB, nproc)  # nproc ranks on the calibrated machine
    return step_time(cfg, hw, saved=_saved())["step_time_s"]


def measure(flags, nproc, iters):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(ROOT, "scripts", "pretrain_gpt.py"), *MODEL, *flags, "--mock-data",
               "--train-iters", str(iters), "--metrics-file", metrics, "--log-interval", "1000"]
        from megazero.process.threads import rank_thread_env
        env = dict(rank_thread_env(force=True), WANDB_MODE="disabled")
        subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=900)
        with open(metrics) as fh:
            times = [json.loads(line)["iteration_time"] for line in fh if line.strip()]
    return statistics.median(times[2:])  # the first iterations warm up


def measure_all(names, nproc, iters, passes):
    """Median over ``passes`` of each layout's median step; the order alternates between passes so
    that a slow spell of the machine does not land on the same layouts."""
    seen = {n: [] for n in names}
    for p in range(passes):
        for name in (names if p % 2 == 0 else names[::-1]):
            seen[name].append(measure(LAYOUTS[name], nproc, iters))
            print(f"  pass {p + 1}: {name}: {seen[name][-1]:.3f} s", file=sys.stderr, flush=True)
    return {n: statistics.median(v) for n, v in seen.items()}, seen


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=8, help="iterations per run (the first two are not timed)")
    p.add_argument("--passes", type=int, default=2, help="runs of each layout (alternating order); median")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--calibration", help="Use this calibration JSON instead of measuring one.")
    p.add_argument("--measured", help="Reuse the measured step times of an earlier --json output.")
    p.add_argument("--json", metavar="PATH",
                   help="Also write calibration, predictions and measurements here.")
    p.add_argument("--published", action="store_true",
                   help="Compare with published large runs instead of measuring here.")
    p.add_argument("--fit", action="store_true", help="With --published: refit the GPU constants first.")
    a = p.parse_args(argv)
    if a.published:
        types = knee = None
        if a.fit:
            from bench.published import fit
            types, knee = fit()
        print(report(types, knee))
        return
    if a.fit:
        p.error("--fit goes with --published")
    if a.calibration:
        from megazero.planning.calibrate import load_calibration
        cal = load_calibration(a.calibration)
    else:
        from megazero.planning.calibrate import calibrate
        cal = calibrate(a.nproc)
    print(f"calibration: alpha {cal['intra'][0] * 1e3:.3f} ms, beta {cal['intra'][1] * 1e9:.3f} s/GB, "
          f"{cal['flops'] / 1e9:.2f} GFLOP/s per rank, {cal['layer_overhead_s'] * 1e3:.3f} ms per layer, "
          f"{cal.get('oversubscription', 1.0):g} ranks per core"
          + (f", dropout {cal['dropout_s'] * 1e9:.1f} ns an element and "
             f"{cal['attention_dropout_s'] * 1e9:.1f} ns an attention score" if "dropout_s" in cal else ""))
    if a.measured:
        with open(a.measured) as fh:
            earlier = json.load(fh)
        measured, runs = earlier["measured_s"], earlier.get("runs_s", {})
    else:
        measured, runs = measure_all(a.layouts, a.nproc, a.iters, a.passes)
    names = [n for n in a.layouts if n in measured]
    print(f"{'layout':<28} {'predicted s':>12} {'measured s':>11} {'ratio':>7}")
    pred = {}
    for name in names:
        pred[name] = predict(LAYOUTS[name], a.nproc, cal)
        print(f"{name:<28} {pred[name]:>12.3f} {measured[name]:>11.3f} {pred[name] / measured[name]:>7.2f}")
    rho = spearman([pred[n] for n in names], [measured[n] for n in names])
    print(f"Spearman rank correlation (predicted vs measured): {rho:.3f} over {len(names)} layouts")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"calibration": cal, "predicted_s": pred, "measured_s": measured, "runs_s": runs,
                       "spearman": rho}, fh, indent=1)


if __name__ == "__main__":
    main()


def _saved():
    """The model's declaration (what it saves, its parameters) that the estimator reads."""
    from megazero_models import saved_activations
    return saved_activations
