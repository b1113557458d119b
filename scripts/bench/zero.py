"""Benchmark megazero's ZeRO stages 0-3 against torch DDP and FSDP2 on the same model and ranks.

A focused tool (a stack of MLP blocks, every stage at once, and the gloo collectives on the bucket
sizes).  The GPT model against every torch-native peer, layout by layout, is
``scripts/bench_peers.py``; its figures are the ones in the README.

Runs on CPU gloo ranks forked by :func:`megazero.process.local_ranks.run_ranks` and prints, side by side, the
step time (median and minimum over rounds, each as a ratio to DDP) and the model-state bytes per
rank next to the formula in docs/design.md (fp32 Adam: 4 + 4 + 8 bytes per parameter, the fp32 parameters
being their own master copy), then the gloo collectives on the bucket sizes.  Every round runs
one step of every mode, in an order rotated per round, after ``--warmup`` steps each; the load
average is printed so a reader can judge the noise.  The defaults take ~30 s.

    python scripts/bench_zero.py            # 2 ranks, 30 rounds
    python scripts/bench_zero.py --ranks 4 --steps 20 --modes ddp zero1 zero2

Measured back to back on a 2-core CPU shared with other jobs (load average ~6-7), 2 ranks,
4.27M parameters, 2 micro-batches x 8 samples per rank, 30 rounds; "before" is commit dafa961
(unfused Adam, float64 norm copy, gloo's reduce-scatter, one 4.27M bucket) under this script:

    mode    before: median ms (x DDP)  min ms (x DDP)   after: median ms (x DDP)  min ms (x DDP)
    ddp            83.6 (1.00)          43.6 (1.00)            85.2 (1.00)          55.4 (1.00)
    fsdp2         275.6 (3.30)         160.7 (3.69)           276.5 (3.24)         192.2 (3.47)
    zero0         121.7 (1.46)          67.3 (1.54)            70.6 (0.83)          53.7 (0.97)
    zero1         104.0 (1.24)          59.3 (1.36)            85.4 (1.00)          49.8 (0.90)
    zero2         164.5 (1.97)         104.8 (2.41)           101.3 (1.19)          68.5 (1.24)
    zero3         204.8 (2.45)         122.9 (2.82)           191.0 (2.24)          97.4 (1.76)

    bytes per rank (MB, equal before and after and to the formula): ddp/zero0 65.22,
    zero1 48.92, zero2 40.76, zero3/fsdp2 32.61

    gloo collectives, median ms:  elements  all_reduce  reduce_scatter  a2a_reduce_scatter  all_gather
                                   4274432     12.64         17.96            9.25              8.23
                                   1052160      5.54          5.96            4.61              3.56

ZeRO-2 stays above 1.1x DDP: it reduce-scatters every micro-batch (2 per step here, against
DDP's one all-reduce in the last) and all-gathers after the step, and gloo's native
reduce-scatter costs as much as an all-reduce (megazero uses all_to_all + a local sum instead,
see :mod:`megazero.zero.comm`).  ZeRO-3 beats FSDP2 but gathers every unit in forward and again
in backward for each micro-batch.  Bytes are measured after a step (ZeRO-2/3 also hold live
buckets during backward).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn


from megazero.config import MegazeroConfig
from megazero.offload.element_bytes import FP32
from megazero.process.distributed import all_gather_single, reduce_scatter_single
from megazero.mesh import ParallelMesh
from bench.timing import interleaved_rounds
from megazero.process.local_ranks import run_ranks
from megazero.errors import EXIT_OK
from megazero.zero import build_optimizer, optimizer_bytes_per_param, zero_model_state_bytes


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.layers = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, h)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _torch_memory(model, opt):
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"param_bytes": _bytes(params), "grad_bytes": _bytes([p.grad for p in params]),
            "optim_bytes": _bytes(state)}


def _run_mode(mode, args, mesh):
    torch.manual_seed(0)
    model = MLPStack(args.hidden, args.layers)
    numel = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(mesh.rank)
    xs = [torch.randn(args.batch, args.hidden, generator=g) for _ in range(args.micro)]
    if mode in ("ddp", "fsdp2"):
        if mode == "ddp":
            net = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in model.layers:
                fully_shard(layer)
            net = fully_shard(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)

        def step():
            opt.zero_grad(set_to_none=False)
            for i, x in enumerate(xs):
                sync = i == len(xs) - 1
                if mode == "ddp" and not sync:
                    with net.no_sync():
                        (net(x).pow(2).mean() / len(xs)).backward()
                else:
                    if mode == "fsdp2":
                        net.set_requires_gradient_sync(sync)
                    (net(x).pow(2).mean() / len(xs)).backward()
            opt.step()
        memory = lambda: _torch_memory(model, opt)  # noqa: E731
    else:
        cfg = MegazeroConfig()
        cfg.parallel.zero_stage = int(mode[-1])
        cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = 0.0, 0.0
        cfg.parallel.ddp_bucket_size = args.bucket_size
        opt = build_optimizer([model], mesh, cfg)

        def step():
            opt.zero_grad()
            for i, x in enumerate(xs):
                opt.prepare_backward(0, i == len(xs) - 1)
                (model(x).pow(2).mean() / len(xs)).backward()
            opt.finish_grad_sync()
            opt.step(1e-4)
        step.bucket_numels = [b.numel for b in opt.buckets]
        memory = opt.memory_bytes
    for _ in range(args.warmup):
        step()
    return step, memory, numel


def _bench(args):
    """Set every mode up, then time them in rounds: each round runs one step of every mode, in an
    order rotated from round to round, so load changes on a shared machine hit every mode alike.
    Returns per mode the median and the minimum over the rounds."""
    mesh = ParallelMesh.build(device=torch.device("cpu"))
    modes = {mode: _run_mode(mode, args, mesh) for mode in args.modes}
    times = interleaved_rounds({mode: step for mode, (step, _, _) in modes.items()}, args.steps, dist.barrier)
    out = {mode: {"time": statistics.median(times[mode]), "min": min(times[mode]), "numel": numel, **memory()}
           for mode, (_, memory, numel) in modes.items()}
    if args.collectives:
        out["collectives"] = _collectives(args, [b for b in _bucket_sizes(modes)])
    return out


def _bucket_sizes(modes):
    """Distinct bucket sizes of the megazero modes (what their collectives move)."""
    return sorted({n for mode, (step, _, _) in modes.items() if mode.startswith("zero")
                   for n in step.bucket_numels}, reverse=True)[:3]


def _collectives(args, sizes):
    """Median ms of each gloo collective on fp32 buffers of the bucket sizes (same ranks)."""
    n, res = dist.get_world_size(), {}
    for size in sizes:
        x, shard, recv = torch.randn(size), torch.empty(size // n), torch.empty(size)
        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "reduce_scatter": lambda: reduce_scatter_single(shard, x),
               "a2a_reduce_scatter": lambda: (dist.all_to_all_single(recv, x), recv.view(n, -1).sum(0)),
               "all_gather": lambda: all_gather_single(x, shard)}
        times = {k: [] for k in ops}
        for _ in range(args.steps):
            for k, op in ops.items():
                dist.barrier()
                start = time.perf_counter()
                op()
                times[k].append(time.perf_counter() - start)
        res[size] = {k: statistics.median(v) for k, v in times.items()}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="samples per micro-batch per rank")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=30, help="timed rounds (one step of every mode each)")
    p.add_argument("--bucket-size", type=int, default=None, help="megazero bucket elements (default: "
                   "megazero.zero.buckets.default_bucket_size)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3"])
    p.add_argument("--no-collectives", dest="collectives", action="store_false",
                   help="skip the micro-benchmark of the gloo collectives on the bucket sizes")
    args = p.parse_args(argv)
    load0 = os.getloadavg()
    res = run_ranks(_bench, args.ranks, args, timeout=1800)[0]
    load1 = os.getloadavg()
    coll = res.pop("collectives", None)
    n = args.ranks
    base = res.get("ddp", next(iter(res.values())))
    numel = next(iter(res.values()))["numel"]
    print(f"{n} ranks, {numel / 1e6:.2f}M parameters (fp32 Adam: formula P=4 G=4 K=8 bytes/param), "
          f"{args.micro} micro-batches x {args.batch} samples per rank, {args.steps} rounds")
    print(f"load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} after, on {os.cpu_count()} CPUs")
    print(f"{'mode':7} {'median ms':>9} {'min ms':>7} {'vs DDP':>7} {'min vs':>7} {'param MB':>9} "
          f"{'grad MB':>8} {'optim MB':>9} {'total MB':>9} {'formula MB':>11}")
    like = {"ddp": 0, "fsdp2": 3}
    for mode, r in res.items():
        stage = like[mode] if mode in like else int(mode[-1])
        adam_fp32 = optimizer_bytes_per_param("adam", mixed_precision=False)  # no master copy
        formula = zero_model_state_bytes(numel, stage, n, FP32, FP32, adam_fp32)["total_bytes"]
        total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        print(f"{mode:7} {r['time'] * 1e3:9.1f} {r['min'] * 1e3:7.1f} {r['time'] / base['time']:7.2f} "
              f"{r['min'] / base['min']:7.2f} {r['param_bytes'] / 2**20:9.2f} {r['grad_bytes'] / 2**20:8.2f} "
              f"{r['optim_bytes'] / 2**20:9.2f} {total / 2**20:9.2f} {formula / 2**20:11.2f}")
    if coll:
        print("gloo collectives, median ms (fp32; reduce-scatter and all-gather move a 1/N shard):")
        for size, t in coll.items():
            print(f"  {size:>9} elements: " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in t.items()))
    return EXIT_OK


if __name__ == "__main__":
    main()
