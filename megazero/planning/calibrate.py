"""Fit the planner's constants on the machine at hand: link alpha/beta, the compute rate, the
per-layer overhead and how many ranks share a processor.

:func:`calibrate` forks ``n`` gloo ranks (:func:`megazero.process.local_ranks.run_ranks`; on a GPU cluster run
the same measurement under torchrun with NCCL) that all work at once, as in training:

- all-reduces of fp32 buffers from 64 KB to 2 MB in groups of 2, 4 and all ranks (every group at
  once), each between two matrix products as in a tensor-parallel layer, less the matrix products
  alone: fitted to the ring model ``t = 2 (n-1) alpha + 2 (n-1) / n * bytes * beta`` by least
  squares.  Measured under load, so alpha includes the wait for a peer that shares a processor;
- a GPT layer's forward and backward (layer norms, fused QKV, causal SDPA, output projection,
  4h GELU MLP) on 256, 512 and 1024 tokens: the least-squares line through the timings gives the
  FLOP/s a rank reaches on real layers (its slope) and the fixed cost of a layer (its intercept,
  the planner's ``layer_overhead_s``;
- dropout: ``dropout_s``, seconds per element of a dropout's forward and backward on ``[tokens, h]``
  activations (a random mask drawn per element, slow on CPUs), and ``attention_dropout_s``, the extra
  seconds per attention score of causal SDPA with dropout over SDPA without (on a CPU the fused
  kernel has no dropout: the math kernel materialises every score, the masked half too, and draws a
  mask over them).  Both default to the assumed ``CPU_*_S`` of :mod:`megazero.planning.hardware`
  for calibrations written before they were measured.

``disk_bytes_per_s``: the disk under ``--calibrate-dir`` (default: the temporary directory), as
the NVMe offload tiers use it: 256 MiB written, then read back, in 1 MiB direct-I/O requests on 4
threads (:class:`megazero.offload.NvmeStore`); bytes moved over the time of both passes.

``core_flops``: a core's peak, the best rate of a 768 x 768 fp32 matrix product on one thread of
the calibrating process (:func:`core_peak`); the planner's MFU on CPU hosts is relative to it.  ``cores``: the
cores this process may use, and ``oversubscription`` the ranks per core (1 when each rank has its
own).  The result (JSON) feeds ``plan.py --calibration FILE``.  On one machine the "intra-node"
and "inter-node" links are the same measurement.
"""
from __future__ import annotations

import json
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.errors import ConfigError
from megazero.process.threads import host_cores, set_rank_threads

SIZES = (16384, 131072, 524288)  # fp32 elements: 64 KB .. 2 MB
HIDDEN, HEADS, SEQ = 256, 4, 256  # the timed layer; batches of 1, 2 and 4 sequences
ROUNDS = 10  # all-reduces per timed loop
PEAK_N = 768  # the square matrix product whose rate is a core's peak


def _timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _layer_step(x: torch.Tensor, w: Dict[str, torch.Tensor]) -> None:
    """Forward and backward of one GPT layer on ``x`` [b, s, h] (pre-norm, no biases)."""
    b, s, h = x.shape
    q, k, v = (F.layer_norm(x, (h,)) @ w["qkv"]).view(b, s, 3, HEADS, h // HEADS).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
    y = x + a @ w["proj"]
    y = y + F.gelu(F.layer_norm(y, (h,)) @ w["fc1"]) @ w["fc2"]
    y.sum().backward()


def layer_flops(tokens: int, h: int = HIDDEN, s: int = SEQ) -> float:
    """Forward + backward FLOPs of :func:`_layer_step` (megazero.planning.flops' count for this layer)."""
    return 3.0 * tokens * (24 * h * h + 4 * s * h)


def _time_layers(repeats: int) -> Dict[int, float]:
    """Median seconds of one layer step at 256, 512 and 1024 tokens."""
    w = {name: (torch.randn(*shape) * 0.02).requires_grad_() for name, shape in
         (("qkv", (HIDDEN, 3 * HIDDEN)), ("proj", (HIDDEN, HIDDEN)), ("fc1", (HIDDEN, 4 * HIDDEN)),
          ("fc2", (4 * HIDDEN, HIDDEN)))}
    out = {}
    for batch in (1, 2, 4):
        x = torch.randn(batch, SEQ, HIDDEN, requires_grad=True)
        _layer_step(x, w)  # warm-up
        dist.barrier()
        out[batch * SEQ] = _timed(lambda: _layer_step(x, w), repeats)
    return out


def _time_dropout(repeats: int) -> Dict[str, float]:
    """``dropout_s`` and ``attention_dropout_s`` (module docstring), at rate 0.1."""
    x = torch.randn(4 * SEQ, 4 * HIDDEN, requires_grad=True)
    grad = torch.ones_like(x)
    dropout = _timed(lambda: F.dropout(x, 0.1, training=True).backward(grad), repeats)
    q, k, v = (torch.randn(2, HEADS, SEQ, HIDDEN // HEADS, requires_grad=True) for _ in range(3))
    out = torch.ones(2, HEADS, SEQ, HIDDEN // HEADS)

    def attention(p: float) -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p).backward(out)
    attention(0.1)
    attention(0.0)  # warm-up
    dist.barrier()
    extra = _timed(lambda: attention(0.1), repeats) - _timed(lambda: attention(0.0), repeats)
    return {"dropout_s": dropout / x.numel(),
            "attention_dropout_s": max(extra, 0.0) / (2 * HEADS * SEQ * SEQ)}


def _time_allreduces(repeats: int) -> List[tuple]:
    """``(group size, bytes, seconds)`` of an all-reduce between matrix products, every group of
    consecutive ranks at once, less the matrix products alone."""
    world, rank = dist.get_world_size(), dist.get_rank()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = []
    for n in sorted({k for k in (2, 4, world) if world % k == 0}):
        groups = [dist.new_group(list(range(r, r + n))) for r in range(0, world, n)]
        group = groups[rank // n]
        for size in SIZES:
            buf = torch.zeros(size)  # sums of zeros stay finite however often it is reduced

            def loop(communicate: bool) -> None:
                for _ in range(ROUNDS):
                    a @ b
                    a @ b
                    if communicate:
                        dist.all_reduce(buf, group=group)
            loop(True)
            dist.barrier()
            plain = _timed(lambda: loop(False), repeats)
            dist.barrier()
            both = _timed(lambda: loop(True), repeats)
            out.append((n, 4 * size, max(both - plain, 0.0) / ROUNDS))
    return out


def core_peak(repeats: int = 10) -> float:
    """FLOP/s of one core on a large fp32 matrix product: the best of ``repeats`` products on one
    thread (a rank's, :func:`megazero.process.threads.set_rank_threads`) in this process (interference only
    slows a product down, so the best is the core's)."""
    threads = torch.get_num_threads()
    set_rank_threads()
    try:
        a, b = torch.randn(PEAK_N, PEAK_N), torch.randn(PEAK_N, PEAK_N)
        a @ b  # warm-up
        best = min(_timed(lambda: a @ b, 1) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return 2.0 * PEAK_N ** 3 / best


def _rank_measurements(repeats: int = 5) -> Dict[str, object]:
    """One rank's timings (every rank runs this together)."""
    return {"allreduce": _time_allreduces(repeats), "layer": _time_layers(repeats),
            "dropout": _time_dropout(repeats)}


def fit_layer(timings: Dict[int, float]) -> tuple:
    """``(flops_per_s, overhead_s)`` of the least-squares line ``t = overhead + layer_flops(tokens)
    / rate`` through the layer timings (two or more token counts)."""
    xs = [layer_flops(t) for t in timings]
    ys = list(timings.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError(f"layer timings do not grow with the work ({timings}); "
                         "calibrate on a quieter machine")
    return 1.0 / slope, max(my - slope * mx, 0.0)


def fit_alpha_beta(points: List[tuple]) -> tuple:
    """Least-squares ``(alpha, beta)`` of the ring all-reduce model from ``(n, bytes, seconds)``."""
    f = [(2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes, t) for n, nbytes, t in points]
    aa, ab, bb = sum(x * x for x, _, _ in f), sum(x * y for x, y, _ in f), sum(y * y for _, y, _ in f)
    at, bt = sum(x * t for x, _, t in f), sum(y * t for _, y, t in f)
    det = aa * bb - ab * ab
    alpha, beta = (at * bb - bt * ab) / det, (aa * bt - ab * at) / det
    if beta <= 0:  # bytes did not matter at these sizes: all latency
        alpha, beta = at / aa, 0.0
    elif alpha < 0:
        alpha, beta = 0.0, bt / bb
    return max(alpha, 0.0), max(beta, 1e-15)


def measure_disk(directory: str, nbytes: int = 256 << 20) -> float:
    """Bytes per second a swap file under ``directory`` moves (module docstring)."""
    from megazero.offload.element_bytes import FP32
    from megazero.offload import NvmeStore
    from megazero.offload.aligned import aligned_empty, typed_view
    piece = 64 << 20
    specs = {f"t{i}": piece // FP32 for i in range(max(1, nbytes // piece))}
    with NvmeStore(directory, specs, name="calibrate") as store:
        buf = typed_view(aligned_empty(piece), 0, piece // FP32, torch.float32).fill_(1.0)
        start = time.perf_counter()
        for h in [store.write_async(n, buf) for n in specs]:
            h.wait()
        for n in specs:  # one buffer: the reads one after the other, each in parallel requests
            store.read_async(n, buf).wait()
        return 2 * len(specs) * piece / (time.perf_counter() - start)


def calibrate(ranks: int = 8, disk_dir: str = None) -> Dict[str, object]:
    """Measure and fit (module docstring); returns the JSON-able constants."""
    from megazero.process.local_ranks import run_ranks
    if ranks < 2:
        raise ValueError(f"--calibrate-ranks must be >= 2, got {ranks}")
    results = run_ranks(_rank_measurements, ranks, timeout=600.0)
    points = [(n, nbytes, statistics.median(r["allreduce"][i][2] for r in results))
              for i, (n, nbytes, _) in enumerate(results[0]["allreduce"])]
    alpha, beta = fit_alpha_beta(points)
    rate, overhead = fit_layer({t: statistics.median(r["layer"][t] for r in results)
                                for t in results[0]["layer"]})
    cores = host_cores()
    sharing = max(1.0, ranks / cores)
    import tempfile
    disk = measure_disk(disk_dir or tempfile.gettempdir())
    return {"ranks": ranks, "backend": "gloo", "intra": [alpha, beta], "inter": [alpha, beta], "flops": rate,
            "layer_overhead_s": overhead, "oversubscription": sharing, "cores": cores,
            **{key: statistics.median(r["dropout"][key] for r in results)
               for key in ("dropout_s", "attention_dropout_s")},
            "core_flops": core_peak(),
            "disk_bytes_per_s": disk, "allreduce_points": points}


def load_calibration(path: str) -> Dict[str, object]:
    """A calibration written by ``plan.py --calibrate``; ConfigError naming the flag when unusable."""
    try:
        with open(path) as fh:
            cal = json.load(fh)
        for key in ("intra", "inter", "flops"):
            cal[key]  # noqa: B018 - presence check
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--calibration {path}: not a calibration file ({err})") from None
    if "cores" not in cal or "core_flops" not in cal:
        raise ConfigError(f"--calibration {path}: written before plan.py --calibrate measured the cores and "
                          "their matmul peak; run plan.py --calibrate again")
    return cal
