#!/usr/bin/env python
"""Eager against ``--compile`` in one process, and CPU MFU against this machine's best fp32 GEMM.

Builds the model twice from the trainer's flags (``--hidden-size``, ``--seq-length``, ``--num-layers``,
``--micro-batch-size``, ``--global-batch-size``, ``--cpu-matmul`` ...; ``--mock-data``, dropout 0),
eager and with each layer compiled, and times the trainer's own step
(``megazero.training.loop._step``) of each in interleaved rounds after warm-up (the first compiled
step, which compiles, is left out).  It also measures the best one-thread fp32 matrix-product rate
of this machine: square products of 1024 to 2048 through ``torch.mm`` and oneDNN, the fastest of
several calls.  It prints the median step time of each, their ratio (compiled / eager; below 1
compiled is faster), and each MFU: model FLOPs per second (Megatron-LM's count,
``megazero.planning.flops``) over that GEMM rate.  One intra-op thread; run it at idle.

    python scripts/bench_compile.py --hidden-size 1024 --seq-length 512 --num-layers 4 --iters 5
    python scripts/bench_compile.py --hidden-size 256 --seq-length 128 --iters 3 --json out.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench import write_json
from bench.timing import interleaved_rounds
from megazero.errors import EXIT_OK, EXIT_USAGE


def best_gemm_flops(reps: int = 3) -> dict:
    """The fastest fp32 product rate (FLOP/s) over a few large square shapes and both libraries."""
    import torch
    from megazero.tensor_parallel.layers import _onednn, onednn_linear_available
    best = {}
    for n in (1024, 1536, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        calls = {"torch.mm": lambda: torch.mm(a, b)}
        if onednn_linear_available():
            calls["onednn"] = lambda: _onednn(a, b)
        for name, fn in calls.items():
            fn()
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                rate = 2 * n ** 3 / (time.perf_counter() - start)
                if rate > best.get("flops", 0):
                    best = {"flops": rate, "shape": n, "library": name}
    return best


def _stepper(cfg, compiled: bool):
    """The trainer's step on a freshly built model (compiled or not)."""
    from dataclasses import replace
    import megazero_models as models
    from megazero.data import build_data, stage_keys
    from megazero.data.loader import StepBatches
    from megazero.mesh import ParallelMesh
    from megazero.planning.flops import hardware_flops_per_iteration, model_flops_per_iteration
    from megazero.training.loop import Position, _step
    from megazero.zero import build_optimizer
    cfg = replace(cfg, precision=replace(cfg.precision, compile=compiled))
    mesh = ParallelMesh.single()
    chunks = models.build_chunks(cfg, mesh)
    opt = build_optimizer(chunks, mesh, cfg)
    pos = Position()
    data = StepBatches(build_data(cfg), cfg.training.micro_batch_size, 0, 1, mesh.device, stage_keys(chunks))
    work = (model_flops_per_iteration(cfg), hardware_flops_per_iteration(cfg), None)
    return lambda: _step(cfg, chunks, opt, data, mesh, pos, cfg.training.global_batch_size, work)


def main(argv=None) -> int:
    from megazero.config import ConfigError, build_parser, parse_args
    from megazero_models import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False,
                                epilog="Every other flag is the trainer's (model and batch).")
    p.add_argument("--iters", type=int, default=5, help="timed rounds (one step of each per round)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps of each first (compiling in the first)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH ('-': stdout)")
    args, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        p.print_help()
        build_parser(PRESETS).print_help()
        return EXIT_OK
    try:
        cfg = parse_args(["--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
                          "--train-iters", str(args.iters + args.warmup + 1), *rest], PRESETS, world_size=1)
    except ConfigError as err:
        print(f"bench_compile.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    from megazero.planning.flops import model_flops_per_iteration
    from megazero.process.threads import set_rank_threads
    set_rank_threads()
    gemm = best_gemm_flops()
    steps = {"eager": _stepper(cfg, False), "compiled": _stepper(cfg, True)}
    start = time.perf_counter()
    steps["compiled"]()
    compile_s = time.perf_counter() - start
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times = interleaved_rounds(steps, args.iters)
    flops = model_flops_per_iteration(cfg)
    out = {"gemm": gemm, "compile_s": compile_s, "model_flops_per_step": flops}
    print(f"best one-thread fp32 GEMM: {gemm['flops'] / 1e9:.1f} GFLOP/s ({gemm['library']}, "
          f"{gemm['shape']}^3); first compiled step {compile_s:.1f} s")
    for name in steps:
        median = statistics.median(times[name])
        out[name] = {"step_s": median, "mfu": flops / median / gemm["flops"], "times": times[name]}
        print(f"{name}: {median * 1e3:.1f} ms/step, {flops / median / 1e9:.1f} model GFLOP/s, "
              f"MFU {out[name]['mfu']:.1%} of the GEMM rate")
    out["ratio"] = out["compiled"]["step_s"] / out["eager"]["step_s"]
    print(f"compiled / eager: {out['ratio']:.3f}")
    if args.json:
        write_json(out, args.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
