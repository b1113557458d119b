#!/usr/bin/env python
"""One-device training throughput: model TFLOP/s and MFU of a ~1B-parameter GPT in bf16.

Three runs of the same GPT-2-shaped model (learned positions, LayerNorm, GELU, biases, tied
embeddings; default 24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary 50304: 1.31B
parameters), one after the other on one device, each ``--warmup`` untimed then ``--steps`` timed
optimizer steps of one micro-batch:

- megazero, one process, bf16 parameters and activations, fp32 master weights and AdamW;
- the same with full activation recomputation (its hardware FLOP/s include the extra forward);
- the same with ``--compile`` (each layer through Inductor: Triton kernels on a GPU), on by default
  on CUDA (``--no-compile`` leaves it out; the first steps pay the compile, so ``--warmup`` >= 2);
- ``transformers``' ``GPT2LMHeadModel`` of the same shape (SDPA attention), fp32 parameters under
  ``torch.autocast(bf16)`` with fused AdamW: what a Hugging Face user runs.

Model FLOPs per step follow Megatron-LM's formula (:mod:`megazero.planning.flops`); MFU divides model
TFLOP/s by the device's bf16 dense peak (printed as "-" where unknown).  ``scripts/gpu_check.sh``
runs this after the GPU tests; docs/performance.md ("The GPU path") has its figures from one H200.
``--device cpu --quick`` runs the same code on a tiny model (a smoke test).

    python scripts/bench_gpu.py                      # the 1.31B model on cuda:0
    python scripts/bench_gpu.py --layers 12 --hidden 768 --heads 12 --seq 1024 --micro-batch 8
    python scripts/bench_gpu.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Dict, Optional

import torch

from bench import write_json

from megazero.errors import EXIT_OK

HF = "transformers GPT2LMHeadModel"
QUICK = dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, micro_batch=2, steps=2, warmup=1)


def _settings(args, recompute: bool, compiled: bool = False) -> dict:
    s = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
             seq_length=args.seq, max_position_embeddings=args.seq, vocab_size=args.vocab,
             make_vocab_size_divisible_by=64, micro_batch_size=args.micro_batch,
             global_batch_size=args.micro_batch, mock_data=True, optimizer="adam", lr=1e-4,
             lr_decay_style="constant", clip_grad=1.0, bf16=args.dtype == "bf16",
             hidden_dropout=0.0, attention_dropout=0.0, activation="gelu",  # the model measured before
             compile=compiled)
    if recompute:
        s.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _megazero(args, device: torch.device, recompute: bool, compiled: bool = False):
    """A megazero training step on ``device``: ``(step, cfg)``."""
    import megazero_models as models
    from megazero.config import config_from_dict, validate
    from megazero.data import build_data, micro_batches
    from megazero.mesh import ParallelMesh
    from megazero.pipeline.executor import run_schedule
    from megazero.pipeline.p2p import p2p_tensor_shape
    from megazero.optim.precision import compute_dtype
    from megazero.zero import build_optimizer
    cfg = validate(config_from_dict(_settings(args, recompute, compiled)), 1)
    mesh = ParallelMesh.single(device)
    dtype = compute_dtype(cfg)
    chunks = [c.to(device=device, dtype=dtype) for c in models.build_chunks(cfg, mesh)]
    opt = build_optimizer(chunks, mesh, cfg)
    batches = micro_batches(build_data(cfg), 0, args.micro_batch, args.micro_batch, device=device)

    def step() -> float:
        opt.zero_grad()
        losses = run_schedule(chunks, mesh, batches, schedule="1f1b", num_micro_batches=1,
                              tensor_shape=p2p_tensor_shape(cfg), dtype=dtype, grad_sync=opt,
                              loss_scale=opt.loss_scale)
        opt.finish_grad_sync()
        opt.step(1e-4)
        return losses[0].item()

    return step, cfg


def _hf(args, device: torch.device):
    """transformers' GPT-2 of the same shape: fp32 parameters, autocast to ``--dtype``, fused AdamW."""
    from bench.peer_models import hf_gpt2
    model = hf_gpt2(args.vocab, args.hidden, args.heads, args.layers, args.seq, device=device)
    model.train()
    fused = device.type in ("cuda", "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
    amp = torch.bfloat16 if args.dtype == "bf16" else None

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach().item()

    return step


def _time(step: Callable[[], float], device: torch.device, warmup: int, steps: int) -> Dict[str, float]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loss = None
    for _ in range(warmup):
        loss = step()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        loss = step()  # float(loss): the step ends on the host
        _sync(device)
        times.append(time.perf_counter() - start)
    out = {"step_s": statistics.median(times), "loss": loss}
    if device.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args) -> Dict[str, dict]:
    """Time every mode; returns per mode the step time, tokens/s, TFLOP/s and MFU."""
    from megazero.planning.flops import (device_peak_flops, hardware_flops_per_iteration,
                                         model_flops_per_iteration)
    device = torch.device(args.device)
    results: Dict[str, dict] = {}
    modes = ["megazero", "megazero + full recompute", "megazero + --compile", HF]
    if not args.compile:
        modes.remove("megazero + --compile")
    peak: Optional[float] = device_peak_flops(device, "bf16" if args.dtype == "bf16" else "fp32")
    for name in modes:
        if name == HF:
            step, cfg = _hf(args, device), _megazero_cfg(args)
        else:
            step, cfg = _megazero(args, device, recompute="recompute" in name, compiled="compile" in name)
        res = _time(step, device, args.warmup, args.steps)
        model_flops, hw_flops = model_flops_per_iteration(cfg), hardware_flops_per_iteration(cfg)
        res.update(tokens_per_s=args.micro_batch * args.seq / res["step_s"],
                   model_tflops=model_flops / res["step_s"] / 1e12, hw_tflops=hw_flops / res["step_s"] / 1e12,
                   mfu=model_flops / res["step_s"] / peak if peak else None)
        if name == HF:
            res["hw_tflops"] = res["model_tflops"]
        results[name] = res
        del step
        _free(device)
    return results


def _megazero_cfg(args):
    from megazero.config import config_from_dict, validate
    return validate(config_from_dict(_settings(args, False)), 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="a tiny model and two steps (a smoke test, e.g. on cpu)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time megazero with --compile (default: on CUDA only)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.compile is None:
        args.compile = torch.device(args.device).type == "cuda"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU; use --device cpu --quick for a smoke test")
    from bench.peer_models import gpt_params
    n = gpt_params(args.vocab, args.hidden, args.layers, args.seq, tied=True, bias=True)
    results = run(args)
    name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    print(f"{name}: GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"vocab {args.vocab}, tied ({n / 1e6:,.1f}M parameters), micro-batch {args.micro_batch}, "
          f"{args.dtype}; median of {args.steps} steps after {args.warmup}")
    print(f"{'mode':30} {'ms/step':>9} {'tokens/s':>10} {'model TFLOP/s':>14} {'hw TFLOP/s':>11} {'MFU':>6} "
          f"{'max GB':>7} {'loss':>7}")
    for mode, r in results.items():
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
        mem = f"{r['max_memory_gb']:.1f}" if "max_memory_gb" in r else "-"
        print(f"{mode:30} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:10.0f} {r['model_tflops']:14.1f} "
              f"{r['hw_tflops']:11.1f} {mfu:>6} {mem:>7} {r['loss']:7.3f}")
    if args.json:
        write_json({"device": name, "params": n, "args": vars(args), "results": results}, args.json)
    return EXIT_OK


if __name__ == "__main__":
    main()
