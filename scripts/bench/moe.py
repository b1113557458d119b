"""Mixture of experts: the grouped expert product against a per-expert loop, and EP 2 against EP 1.

Two measurements, each a ratio against a baseline timed in the same run, in interleaved rounds
(:func:`bench.timing.interleaved_rounds`: every round runs every variant once, in a rotated order):

1. **Experts, one process.**  A rank's experts (:class:`megazero.moe.GroupedExperts`, gated or not)
   forward and backward on ``--tokens`` routed rows spread unevenly over ``--experts`` experts, as
   megazero runs them with ``--moe-grouped-gemm`` (one padded ``bmm`` per matrix on CPU:
   :func:`megazero.moe.experts.grouped_product`) against the plain-PyTorch reference that
   transformers' Mixtral block uses: a Python loop over the experts, each taking its rows and
   running its own matrices (megazero's default, without the flag).  Same weights and rows; the
   script checks that both give the same outputs and gradients before timing them.  Once with the rows
   skewed over the experts (the padded ``bmm`` pads each to the longest) and once balanced (equal
   rows: no padding).
2. **EP 2 against EP 1, through the trainer's pieces.**  A tiny MoE GPT (the oracle tests' model:
   8 experts, top-2, a shared expert with its gate, one dense layer in two) on ``--ranks`` gloo ranks,
   one optimizer step at a time (pipeline executor, ZeRO optimizer, the routers' step) with every
   expert on every rank (EP 1, expert DP = DP) and with the experts split over two ranks (EP 2).
   Also timed: one all-to-all of the dispatched rows of one MoE layer and micro-batch
   (``tokens x topk x hidden`` fp32 across the EP group), the collective an EP layer runs four times a
   micro-batch (tokens out and back, forward and backward).

``--json -`` prints the results as JSON; ``--quick`` shrinks everything (the smoke test).  DeepSpeed-MoE's
layer: ``scripts/bench_moe_deepspeed.py``.

    python scripts/bench_moe.py                     # 8 experts, 2 ranks, 20 rounds each
    python scripts/bench_moe.py --experts 16 --tokens 8192 --rounds 30
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import write_json
from bench.timing import interleaved_rounds
from megazero.config import config_from_dict, validate
from megazero.errors import EXIT_OK
from megazero.process.local_ranks import run_ranks
from megazero.mesh import ParallelMesh
from megazero.process.threads import set_rank_threads


# ---- 1. the grouped product against a loop over experts --------------------------------------------
def _expert_cfg(args):
    return validate(config_from_dict(dict(
        mock_data=True, num_layers=1, hidden_size=args.hidden, num_attention_heads=4, seq_length=16,
        vocab_size=128, add_bias_linear=False, activation="swiglu" if args.gated else "gelu",
        num_experts=args.experts, moe_ffn_hidden_size=args.ffn, moe_router_topk=2)), 1)


def _counts(tokens: int, experts: int, seed: int = 0, balanced: bool = False):
    """Uneven rows per expert (a skewed routing), summing to ``tokens``; ``balanced``: as even as they
    divide (equal rows need no padding)."""
    if balanced:
        return [tokens // experts + (1 if j < tokens % experts else 0) for j in range(experts)]
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=g) + 0.5
    counts = (weights / weights.sum() * tokens).floor().to(torch.int64)
    counts[0] += tokens - int(counts.sum())
    return counts.tolist()


def loop_experts(experts, x: torch.Tensor, counts):
    """transformers' Mixtral way: one expert at a time, its rows through its own matrices."""
    out, start = [], 0
    for j, c in enumerate(counts):
        rows = x[start:start + c]
        h = F.linear(rows, experts.fc1_weight[j])
        # the experts' own activation (megazero.tensor_parallel.activations): gate, then h
        h = experts.act(h, F.linear(rows, experts.gate_weight[j])) if experts.gated else experts.act(h)
        out.append(F.linear(h, experts.fc2_weight[j]))
        start += c
    return torch.cat(out)


def bench_experts(args, balanced: bool = False):
    """Median seconds of forward + backward, grouped and looped, and their largest difference
    (``balanced``: every expert the same rows)."""
    from megazero.moe import GroupedExperts
    cfg = _expert_cfg(args)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    experts = GroupedExperts(cfg, ParallelMesh.single(torch.device("cpu")), 0, backend="auto")  # grouped
    experts = experts.to(device=device, dtype=dtype)  # on a GPU "auto" is torch's grouped_mm
    counts = _counts(args.tokens, args.experts, balanced=balanced)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    results = {}

    def run(name, fn):
        def step():
            x.grad = None
            experts.zero_grad(set_to_none=True)
            y = fn(experts, x, counts)
            y.backward(grad_out)
            results[name] = (y.detach(), x.grad.clone(), experts.fc1_weight.grad.clone())
        return step
    steps = {"loop": run("loop", loop_experts), "grouped": run("grouped", lambda e, v, c: e(v, c))}
    for step in steps.values():
        step()
    diff = max(float((a - b).abs().max()) for a, b in zip(results["loop"], results["grouped"]))
    scale = max(float(t.abs().max()) for t in results["loop"])
    if diff > (1e-4 if dtype == torch.float32 else 3e-2) * scale:  # bf16: a few roundings of 2^-8
        raise SystemExit(f"bench_moe: grouped and looped experts differ by {diff:.3g} (scale {scale:.3g})")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = interleaved_rounds(steps, args.rounds, sync)
    return {"counts": counts, "max_abs_diff": diff,
            **{k: statistics.median(v) for k, v in times.items()}}


# ---- 2. EP 2 against EP 1 through the trainer's pieces ---------------------------------------------
def model_settings(args, ep: int):
    """The tiny MoE GPT of ``tests/test_moe_training.py`` (scaled by the flags) at EP ``ep``."""
    return dict(mock_data=True, num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                seq_length=args.seq_length, vocab_size=256, micro_batch_size=args.micro_batch_size,
                global_batch_size=args.micro_batch_size * args.ranks * 2, optimizer="adam", lr=1e-4,
                hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, activation="swiglu",
                num_experts=args.experts, moe_router_topk=2,
                moe_layer_freq="([0]*1+[1]*1)*%d" % (args.layers // 2),
                moe_ffn_hidden_size=args.ffn, moe_shared_expert_intermediate_size=args.ffn,
                moe_shared_expert_gate=True, moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall",
                expert_model_parallel_size=ep)


def _trainer_step(cfg):
    """One optimizer step of ``cfg`` on this rank, as the trainer runs it (a closure)."""
    from megazero.data import build_data, micro_batches
    from megazero.moe.step import finish_step
    from megazero.pipeline.executor import run_schedule
    from megazero.pipeline.p2p import p2p_tensor_shape
    from megazero.tensor_parallel.rng import seed_default_generators
    from megazero.training import build_mesh
    from megazero.zero import build_optimizer
    import megazero_models as models
    mesh = build_mesh(cfg)
    tr = cfg.training
    seed_default_generators(tr.seed, mesh)
    chunks = models.build_chunks(cfg, mesh)
    for c in chunks:
        c.train()
    optimizer, data = build_optimizer(chunks, mesh, cfg), build_data(cfg)
    state = {"it": 0}

    def step():
        optimizer.zero_grad()
        batches = micro_batches(data, state["it"], tr.global_batch_size, tr.micro_batch_size,
                                mesh.coord("dp"), mesh.size("dp"), device=mesh.device)
        run_schedule(chunks, mesh, batches, schedule=cfg.parallel.pipeline_schedule,
                     num_micro_batches=len(batches), tensor_shape=p2p_tensor_shape(cfg),
                     dtype=torch.float32, grad_sync=optimizer, loss_scale=float(optimizer.loss_scale))
        optimizer.finish_grad_sync()
        finish_step(chunks, mesh, cfg, len(batches))
        optimizer.step(1e-4)
        state["it"] += 1
    return step


def _rank_ep(args):
    set_rank_threads()
    steps = {f"ep{ep}": _trainer_step(validate(config_from_dict(model_settings(args, ep)), args.ranks))
             for ep in (1, 2)}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    rows = args.micro_batch_size * args.seq_length * 2  # tokens x topk of one micro-batch
    send = torch.randn(rows, args.hidden)
    recv = torch.empty_like(send)
    group = dist.new_group(list(range(2))) if args.ranks > 2 else None
    if dist.get_rank() < 2:
        steps["all_to_all"] = lambda: dist.all_to_all_single(recv, send, group=group)
    else:
        steps["all_to_all"] = lambda: None
    times = interleaved_rounds(steps, args.rounds, dist.barrier)
    return {k: statistics.median(v) for k, v in times.items()}


# ---- the command line ------------------------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="routed rows of the experts benchmark")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="--moe-ffn-hidden-size")
    p.add_argument("--no-gated", dest="gated", action="store_false", help="GELU experts instead of SwiGLU")
    p.add_argument("--layers", type=int, default=4, help="transformer layers of the EP model (even)")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks of the EP benchmark (even)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu", help="the experts benchmark's device (cuda: grouped_mm)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the experts benchmark's dtype")
    p.add_argument("--experts-only", action="store_true", help="skip the EP benchmark (gloo ranks)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds (a smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.ffn, args.seq_length, args.micro_batch_size = 256, 32, 48, 16, 2
        args.rounds, args.warmup = 2, 1
    if args.experts % 2 or args.ranks % 2 or args.ranks < 2 or args.layers % 2 or args.layers < 2:
        p.error("--experts and --ranks must be even (EP 2), --ranks at least 2, --layers even and >= 2")
    set_rank_threads()
    experts, balanced = bench_experts(args), bench_experts(args, balanced=True)
    ep = None if args.experts_only else run_ranks(_rank_ep, args.ranks, args, timeout=1800)[0]
    out = {"cpu": _cpu_name(), "load_average": os.getloadavg()[0], "experts": experts,
           "experts_balanced": balanced, "ep": ep, "device": args.device, "dtype": args.dtype,
           "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None}
    _print(args, out)
    if args.json:
        write_json(out, args.json)
    return EXIT_OK


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def _print(args, out) -> None:
    e, r = out["experts"], out["ep"]
    print(f"CPU {out['cpu']}, load average {out['load_average']:.1f}, torch {torch.__version__}; experts on "
          f"{out['gpu'] or args.device} in {args.dtype}")
    print(f"experts: {args.experts} x ({'SwiGLU' if args.gated else 'GELU'} {args.hidden} -> {args.ffn}), "
          f"{args.tokens} rows {e['counts']}, fwd+bwd, median of {args.rounds} rounds "
          f"(max |difference| {e['max_abs_diff']:.2e})")
    print(f"  loop over experts {e['loop'] * 1e3:8.2f} ms   grouped {e['grouped'] * 1e3:8.2f} ms   "
          f"loop / grouped {e['loop'] / e['grouped']:.2f}x")
    b = out["experts_balanced"]
    print(f"  balanced rows {b['counts'][0]} each (no padding): loop {b['loop'] * 1e3:8.2f} ms   grouped "
          f"{b['grouped'] * 1e3:8.2f} ms   loop / grouped {b['loop'] / b['grouped']:.2f}x")
    if r is None:
        return
    print(f"EP on {args.ranks} ranks: {args.layers} layers (MoE every second), {args.experts} experts top-2, "
          f"hidden {args.hidden}, micro-batch {args.micro_batch_size} x {args.seq_length}, one step")
    print(f"  EP 1 {r['ep1'] * 1e3:8.2f} ms   EP 2 {r['ep2'] * 1e3:8.2f} ms   EP 2 / EP 1 "
          f"{r['ep2'] / r['ep1']:.2f}x   one all-to-all of a layer's dispatched rows "
          f"{r['all_to_all'] * 1e3:.2f} ms ({r['all_to_all'] / r['ep2'] * 100:.1f}% of an EP 2 step)")


if __name__ == "__main__":
    sys.exit(main())
