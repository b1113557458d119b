"""Measured vs theoretical pipeline bubble on CPU ranks (gloo, forked with
megazero.process.local_ranks.run_ranks).

Each stage's compute is emulated by sleeping (forward ``--fwd-ms``, backward twice that, split over
the virtual chunks) so the measurement is not distorted by ranks sharing a few CPU cores; ``--matmul``
uses real matrix products instead.  For every (pp, m, schedule) it prints the theoretical bubble
``(p - 1) / (v m + p - 1)``, the schedule simulator's value without and with a cost per
message (``--comm-ms``; gloo on a busy CPU host takes about a millisecond), and the measured idle fraction
``1 - compute / step time`` (mean over stages, median of ``--repeat`` runs; compute time from
:class:`megazero.pipeline.executor.PipelineTimer`, step time from barrier to barrier), and the
share of the step spent waiting in p2p.

    python scripts/bench_pipeline.py --pp 2 4 --m 1 4 8 16

Measured on 2 shared CPU cores (``--fwd-ms 20``; bubble as a fraction of the step):

    pp  m  schedule        theory  sim+comm(1ms)  measured
     2  4  1f1b             0.200     0.213         0.212
     2  4  interleaved v2   0.111     0.146         0.149
     4  8  gpipe            0.273     0.294         0.315
     4  8  1f1b             0.273     0.293         0.302
     4  8  interleaved v2   0.158     0.193         0.214
     4 16  1f1b             0.158     0.183         0.177
     4 16  interleaved v2   0.086     0.120         0.124

GPipe and 1F1B match ``(p - 1) / (m + p - 1)`` plus about a millisecond per message; the
interleaved schedule sends ``v`` times as many messages, so on gloo it gains less than theory.
"""
from __future__ import annotations

import argparse
import time


import torch
import torch.distributed as dist

from megazero.mesh import ParallelMesh
from megazero.pipeline.executor import PipelineTimer, run_schedule
from megazero.pipeline.schedules import bubble_fraction, build_schedule, simulate

S, B, H = 16, 2, 64


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g, None, None


class BenchChunk(torch.nn.Module):
    """A chunk that costs a fixed time (sleep) or a fixed amount of matmuls."""

    def __init__(self, pre, post, fwd_s, matmul):
        super().__init__()
        self.pre_process, self.post_process, self.fwd_s, self.matmul = pre, post, fwd_s, matmul
        self.w = torch.nn.Parameter(torch.randn(H, H) / H ** 0.5)
        self.reps = max(1, int(fwd_s * 400))  # roughly fwd_s of matmuls on one core

    def forward(self, x, labels=None, loss_mask=None):
        if self.pre_process:
            x = torch.nn.functional.one_hot(x.t() % H, H).float()
        if self.matmul:
            for _ in range(self.reps):
                x = torch.tanh(x @ self.w)
        else:
            x = _Sleep.apply(x @ self.w, self.fwd_s, 2 * self.fwd_s)
        return x.pow(2).mean(-1).t() if self.post_process else x


def _rank(configs, fwd_s, matmul, repeat):
    out = []
    for pp, m, name, vp in configs:
        mesh = ParallelMesh.build(pp=pp) if dist.get_world_size() == pp else None
        if mesh is None:
            raise RuntimeError("world size must equal pp")
        chunks = [BenchChunk(mesh.coord("pp") == 0 and v == 0, mesh.is_last_stage and v == vp - 1, fwd_s / vp,
                             matmul) for v in range(vp)]
        mbs = [{"tokens": torch.randint(0, 100, (B, S)), "labels": torch.zeros(B, S, dtype=torch.long),
                "loss_mask": torch.ones(B, S)} for _ in range(m)]
        kw = dict(schedule=name, num_micro_batches=m, tensor_shape=(S, B, H))
        run_schedule(chunks, mesh, mbs, **kw)  # warm-up
        runs = []
        for _ in range(repeat):
            dist.barrier(group=mesh.group("pp"))
            timer, start = PipelineTimer(), time.perf_counter()
            run_schedule(chunks, mesh, mbs, timer=timer, **kw)
            dist.barrier(group=mesh.group("pp"))  # a step ends when the slowest stage is done
            makespan = time.perf_counter() - start
            runs.append(dict(timer.as_dict(), makespan_s=makespan, bubble=1 - timer.compute_s / makespan))
        out.append(runs)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--vp", type=int, default=2, help="virtual chunks for the interleaved schedule")
    p.add_argument("--fwd-ms", type=float, default=10.0, help="forward time per stage (backward is 2x)")
    p.add_argument("--comm-ms", type=float, default=1.0, help="per-message cost for the 'sim+comm' column")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per setting; the median is shown")
    p.add_argument("--matmul", action="store_true", help="real matmuls instead of sleeping")
    args = p.parse_args(argv)
    from megazero.process.local_ranks import run_ranks
    from megazero.process.threads import set_rank_threads
    set_rank_threads()
    print(f"{'pp':>3} {'m':>3} {'schedule':>14} {'theory':>7} {'simulated':>9} {'sim+comm':>8} "
          f"{'measured':>8} {'p2p wait':>8}")
    for pp in args.pp:
        configs = []
        for m in args.m:
            configs += [(pp, m, "gpipe", 1), (pp, m, "1f1b", 1)]
            if m % pp == 0:
                configs.append((pp, m, "interleaved", args.vp))
        results = run_ranks(_rank, pp, configs, args.fwd_ms / 1000, args.matmul, args.repeat, timeout=900)
        for k, (pp_, m, name, vp) in enumerate(configs):
            sched = build_schedule(name, pp_, m, vp)
            sim = simulate(sched, vp=vp, m=m).bubble()
            lat = simulate(sched, vp=vp, m=m, fwd_time=args.fwd_ms, bwd_time=2 * args.fwd_ms,
                           comm_time=args.comm_ms).bubble()
            per_run = [(sum(r[k][i]["bubble"] for r in results) / pp,
                        sum(r[k][i]["p2p_wait_s"] / r[k][i]["makespan_s"] for r in results) / pp)
                       for i in range(args.repeat)]
            measured, wait = sorted(per_run)[len(per_run) // 2]  # the median run
            label = name + (f" v{vp}" if vp > 1 else "")
            print(f"{pp_:>3} {m:>3} {label:>14} {bubble_fraction(pp_, m, vp):>7.3f} {sum(sim) / pp:>9.3f} "
                  f"{sum(lat) / pp:>8.3f} {measured:>8.3f} {wait:>8.3f}")


if __name__ == "__main__":
    main()
