"""Benchmark megazero's ZeRO stages 0-3 against torch DDP and FSDP2 on the same model and ranks.

Runs on CPU gloo ranks forked by :func:`megazero.testing.run_ranks` (or on the current process
group's devices when started under torchrun) and prints, side by side, the step time (ratio to
DDP) and the model-state bytes per rank next to DESIGN.md's formula (fp32 Adam: 4 + 4 + 8 bytes
per parameter, the fp32 parameters being their own master copy).

    python scripts/bench_zero.py --ranks 4 --hidden 256 --layers 8 --steps 5

Measured with the defaults (2-core CPU shared with other jobs, load average ~25, so times are noisy;
gloo, 4 ranks, 4.27M parameters, 2 micro-batches x 8 samples per rank, median of 9 rounds):

    mode     step ms  vs DDP  param MB  grad MB  optim MB  total MB  formula MB
    ddp        130.1    1.00     16.31    16.31     32.61     65.22       65.22
    fsdp2      436.3    3.35      4.08     4.08      8.15     16.31       16.31
    zero0      163.9    1.26     16.31    16.31     32.61     65.22       65.22
    zero1      152.5    1.17     16.31    16.31      8.15     40.76       40.76
    zero2      238.4    1.83     16.31     4.08      8.15     28.53       28.53
    zero3      334.4    2.57      4.08     4.08      8.15     16.31       16.31

Bytes are measured after a step (ZeRO-2/3 also hold one live bucket during backward).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.config import MegazeroConfig  # noqa: E402
from megazero.mesh import ParallelMesh  # noqa: E402
from megazero.testing import run_ranks  # noqa: E402
from megazero.zero import build_optimizer, zero_model_state_bytes  # noqa: E402


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
        memory = opt.memory_bytes
    for _ in range(args.warmup):
        step()
    return step, memory, numel


def _bench(args):
    """Set every mode up, then time them round-robin (one step each per round; median per mode) so
    load changes on a shared machine hit every mode alike."""
    mesh = ParallelMesh.build(device=torch.device("cpu"))
    modes = {mode: _run_mode(mode, args, mesh) for mode in args.modes}
    times = {mode: [] for mode in modes}
    for _ in range(args.steps):
        for mode, (step, _, _) in modes.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times[mode].append(time.perf_counter() - start)
    return {mode: {"time": sorted(times[mode])[len(times[mode]) // 2], "numel": numel, **memory()}
            for mode, (_, memory, numel) in modes.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="samples per micro-batch per rank")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=7, help="timed rounds (median reported)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="megazero bucket elements (default min(model, 10M))")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3"])
    args = p.parse_args(argv)
    res = run_ranks(_bench, args.ranks, args, timeout=1800)[0]
    n = args.ranks
    base = res.get("ddp", next(iter(res.values())))["time"]
    numel = next(iter(res.values()))["numel"]
    print(f"{n} ranks, {numel / 1e6:.2f}M parameters (fp32 Adam: formula P=4 G=4 K=8 bytes/param), "
          f"{args.micro} micro-batches x {args.batch} samples per rank")
    print(f"{'mode':7} {'step ms':>8} {'vs DDP':>7} {'param MB':>9} {'grad MB':>8} {'optim MB':>9} "
          f"{'total MB':>9} {'formula MB':>11}")
    like = {"ddp": 0, "fsdp2": 3}
    for mode, r in res.items():
        stage = like[mode] if mode in like else int(mode[-1])
        formula = zero_model_state_bytes(numel, stage, n, 4, 4, 8)["total_bytes"]
        total = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        print(f"{mode:7} {r['time'] * 1e3:8.1f} {r['time'] / base:7.2f} {r['param_bytes'] / 2**20:9.2f} "
              f"{r['grad_bytes'] / 2**20:8.2f} {r['optim_bytes'] / 2**20:9.2f} {total / 2**20:9.2f} "
              f"{formula / 2**20:11.2f}")
    return res


if __name__ == "__main__":
    main()
