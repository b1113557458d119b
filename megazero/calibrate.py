"""Fit the planner's constants on the machine at hand: link alpha/beta and the compute rate.

:func:`calibrate` forks ``n`` gloo ranks (:func:`megazero.testing.run_ranks`; on a GPU cluster run
the same measurement under torchrun with NCCL) that all work at once, as in training:

- all-reduces of fp32 buffers from 4 KB to 4 MB, fitted to the ring model
  ``t = 2 (n-1) alpha + 2 (n-1) / n * bytes * beta`` by least squares;
- matmuls of training-like shapes: FLOP/s one rank reaches while every rank computes;
- the per-operation overhead of small autograd ops (forward + backward of a tiny tensor),
  times the ~60 such operations of a transformer layer's forward and backward: the planner's
  ``layer_overhead_s``.

The result (JSON) feeds ``plan.py --calibration FILE``.  On one machine the "intra-node" and
"inter-node" links are the same measurement.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist

SIZES = (1024, 16384, 131072, 1048576)  # fp32 elements: 4 KB .. 4 MB
OPS_PER_LAYER = 60


def _timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _rank_measurements(repeats: int = 7) -> Dict[str, object]:
    """One rank's timings (every rank runs this together)."""
    out: Dict[str, object] = {"allreduce": []}
    for n in SIZES:
        buf = torch.ones(n)
        dist.barrier()
        t = _timed(lambda: dist.all_reduce(buf), repeats)
        out["allreduce"].append((4 * n, t))
    a, b = torch.randn(512, 256), torch.randn(256, 1024)
    dist.barrier()
    t = _timed(lambda: a @ b, repeats * 3)
    out["flops"] = 2 * 512 * 256 * 1024 / t
    x = torch.randn(8, 8, requires_grad=True)
    dist.barrier()
    t = _timed(lambda: (x * 2.0).sum().backward(), repeats * 5)
    out["op_overhead_s"] = t / 3  # three tiny ops (mul, sum, their backward) per sample
    return out


def fit_alpha_beta(points: List[tuple], n: int) -> tuple:
    """Least-squares ``(alpha, beta)`` of the ring all-reduce model from ``(bytes, seconds)``."""
    xs = [2 * (n - 1) / n * nbytes for nbytes, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - beta * mx, 0.0) / (2 * (n - 1))
    return alpha, max(beta, 1e-15)


def calibrate(ranks: int = 8) -> Dict[str, object]:
    """Measure and fit (module docstring); returns the JSON-able constants."""
    from megazero.testing import run_ranks
    if ranks < 2:
        raise ValueError(f"--calibrate-ranks must be >= 2, got {ranks}")
    results = run_ranks(_rank_measurements, ranks, timeout=600.0)
    points = [(nbytes, max(r["allreduce"][i][1] for r in results)) for i, (nbytes, _) in
              enumerate(results[0]["allreduce"])]
    alpha, beta = fit_alpha_beta(points, ranks)
    flops = statistics.median(r["flops"] for r in results)
    overhead = statistics.median(r["op_overhead_s"] for r in results) * OPS_PER_LAYER
    return {"ranks": ranks, "backend": "gloo", "intra": [alpha, beta], "inter": [alpha, beta], "flops": flops,
            "layer_overhead_s": overhead, "allreduce_points": points}


def load_calibration(path: str) -> Dict[str, object]:
    """A calibration written by ``plan.py --calibrate``; ConfigError naming the flag when unusable."""
    from megazero.config import ConfigError
    try:
        with open(path) as fh:
            cal = json.load(fh)
        for key in ("intra", "inter", "flops"):
            cal[key]  # noqa: B018 - presence check
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--calibration {path}: not a calibration file ({err})") from None
    return cal
