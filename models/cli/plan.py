"""``scripts/plan.py`` / ``megazero-plan``: rank the layouts that fit a cluster by estimated step
time (:mod:`megazero.planning.planner`), on GPUs or on CPU hosts whose ranks share the host."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence

from megazero.config import ConfigError
from megazero.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from megazero.planning.hardware import (ALPHA_INTER, ALPHA_INTRA, ATTENTION_KERNELS, GB, GPUS, Hardware,
                                        default_device, from_args)
from megazero.planning.planner import RECOMPUTE, Layout, plan
from megazero.planning.report import advice, describe, flags, model_config, to_dict

from .. import saved_activations
from .launch_script import KINDS, launch_script


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="plan.py", description="Rank the layouts that fit a cluster by "
                                "estimated step time. Model flags (--model PRESET or --num-layers, "
                                "--hidden-size, ...) and the offload tiers (--offload-optimizer-device, "
                                "--offload-param-device, --nvme-path) are those of pretrain_gpt.py.")
    p.add_argument("--gpus", type=int, help="GPUs in total, or ranks with --device cpu (required unless "
                   "--calibrate).")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (TP stays inside a node; default 8), or "
                   "ranks per host with --device cpu (default: all on one host).")
    p.add_argument("--device", choices=["cuda", "cpu"], help="cuda: GPUs, each with its own memory; cpu: "
                   "CPU ranks sharing each host's cores, memory and disk. Default: cpu with --calibration or "
                   "a --host-* flag, cuda with a --gpu* flag, else cuda where this machine has a GPU and cpu "
                   "(this machine) where not.")
    p.add_argument("--host-cores", type=int, help="--device cpu: cores per host (default: this machine's).")
    p.add_argument("--host-memory-gb", type=float,
                   help="--device cpu: memory per host in GB, shared by its ranks (default: this machine's).")
    p.add_argument("--host-disk-gb", type=float, help="--device cpu: free disk per host in GB for the NVMe "
                   "tiers' swap files (default: the free space under --nvme-path, or the temporary "
                   "directory).")
    p.add_argument("--gpu", help=f"GPU type for defaults: {', '.join(GPUS)} (SXM figures; default H100).")
    p.add_argument("--gpu-memory-gb", type=float, help="Memory per GPU in GB (default: the --gpu's).")
    p.add_argument("--gpu-tflops", type=float,
                   help="Dense 16-bit peak TFLOP/s per GPU (default: the --gpu's).")
    p.add_argument("--efficiency", type=float,
                   help="Time every matmul at this fraction of peak instead of the --gpu's efficiency by "
                        "shape (docs/planning.md).")
    p.add_argument("--attention-backend", choices=sorted(ATTENTION_KERNELS), default="auto",
                   help="Megatron-LM's attention kernel to model: flash, fused and auto keep no s x s "
                        "scores; unfused and local (older stacks) write and keep them (time and memory).")
    p.add_argument("--intra-node-bandwidth", type=float,
                   help="GB/s per GPU inside a node (default: --gpu's).")
    p.add_argument("--inter-node-bandwidth", type=float,
                   help="GB/s per GPU between nodes (default: --gpu's).")
    p.add_argument("--intra-node-latency-us", type=float, default=ALPHA_INTRA * 1e6)
    p.add_argument("--inter-node-latency-us", type=float, default=ALPHA_INTER * 1e6)
    p.add_argument("--calibration",
                   help="JSON from --calibrate (this CPU machine's constants; implies --device cpu).")
    p.add_argument("--calibrate", action="store_true",
                   help="Measure the link, compute and disk constants on this machine and print them as "
                        "JSON.")
    p.add_argument("--calibrate-ranks", type=int, default=8, help="Ranks for --calibrate.")
    p.add_argument("--calibrate-dir", help="Directory on the disk --calibrate measures for NVMe offload "
                   "(default: the temporary directory; give the --nvme-path you will train with).")
    p.add_argument("--margin", type=float, default=0.1, help="Keep this fraction of memory free.")
    p.add_argument("--micro-batch-sizes", type=int, nargs="+", help="Only these micro-batch sizes.")
    p.add_argument("--recompute", nargs="+", choices=RECOMPUTE, help="Only these recomputation modes.")
    p.add_argument("--zero-stages", type=int, nargs="+", choices=[0, 1, 2, 3], help="Only these ZeRO stages.")
    p.add_argument("--top", type=int, default=5, help="Layouts to print.")
    p.add_argument("--json", action="store_true", help="Print the fitting layouts as JSON, best first.")
    p.add_argument("--fp32", action="store_true",
                   help="Plan fp32 training (default bf16 on GPUs; fp32 on CPUs, where bf16 matmuls are "
                        "slow).")
    p.add_argument("--emit-launch", choices=KINDS,
                   help="Write the launch script of the fastest layout (SLURM batch script, or torchrun on "
                        "every node) to --emit-path, or print it alone.")
    p.add_argument("--emit-path", help="File for --emit-launch (made executable).")
    return p


def _where(gpus: int, hw: Hardware) -> str:
    """The cluster in words: GPUs of their memory, or ranks sharing hosts."""
    if hw.device != "cpu":
        return f"{gpus} GPUs of {hw.memory_bytes / GB:.0f} GB"
    hosts = -(-gpus // hw.gpus_per_node)
    one = f"{hw.cores} cores and {hw.memory_bytes / GB:.0f} GB"
    if hosts == 1:
        return f"{gpus} ranks sharing one host of {one}" if gpus > 1 else f"one rank on a host of {one}"
    return f"{gpus} ranks on {hosts} hosts, {hw.gpus_per_node} ranks sharing each host's {one}"


def _print_table(found: List[Layout], cfg, model_args, top: int, gpus: int, hw: Hardware) -> None:
    cpu = hw.device == "cpu"
    print(f"{len(found)} layouts fit {_where(gpus, hw)}; fastest first:")
    width = max([len("layout")] + [len(describe(x)) for x in found[:top]])
    mem = "host GB" if cpu else "mem GB"
    print(f"{'#':>2} {'layout':<{width}} {mem:>7} {'step s':>8} {'tokens/s':>10} {'MFU':>6}")
    for i, x in enumerate(found[:top], 1):
        print(f"{i:>2} {describe(x):<{width}} {(x.host_bytes if cpu else x.memory_bytes) / GB:>7.1f} "
              f"{x.step['step_time_s']:>8.3f} {x.step['tokens_per_sec']:>10.0f} {x.step['mfu']:>6.1%}")
        print(f"   pretrain_gpt.py {' '.join(flags(x, model_args, cfg))}")


def _setup(args, model_args, presets):
    """The base config and the hardware (ConfigError naming a bad flag)."""
    if args.gpus is None:
        raise ConfigError("--gpus is required (GPUs in total, or ranks with --device cpu)")
    for flag, v in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node), ("--top", args.top)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {v}")
    if args.global_batch_size is None:
        raise ConfigError("--global-batch-size is required (sequences per optimizer step)")
    if args.emit_path and not args.emit_launch:
        raise ConfigError("--emit-path goes with --emit-launch slurm|torchrun")
    args.device = default_device(args)
    cfg = model_config(model_args, presets, args.seq_length, args.global_batch_size,
                       args.fp32 or args.device == "cpu")
    return cfg, from_args(args, cfg.parallel.nvme_path)


def main(argv: Optional[Sequence[str]], presets) -> int:
    """``plan.py``; exit status 2 with a message naming the flag on bad input."""
    p = _parser()
    p.add_argument("--seq-length", type=int, help="Sequence length (default: the model's).")
    p.add_argument("--global-batch-size", type=int, help="Sequences per optimizer step.")
    args, model_args = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.calibrate:
            from megazero.planning.calibrate import calibrate
            print(json.dumps(calibrate(args.calibrate_ranks, args.calibrate_dir), indent=2))
            return EXIT_OK
        cfg, hw = _setup(args, model_args, presets)
    except ConfigError as err:
        print(f"plan.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    choices = {"micro_batch_sizes": args.micro_batch_sizes, "recompute": args.recompute,
               "zero_stages": args.zero_stages}
    found = plan(cfg, args.gpus, hw, args.margin, saved=saved_activations,
                 **{k: v for k, v in choices.items() if v})
    change = None if found else advice(cfg, args.gpus, hw, args.margin, choices, saved=saved_activations)
    if args.json:
        out = [to_dict(x, model_args, cfg) for x in found]
        if not found:
            print(json.dumps({"layouts": [], "advice": change}))
            return EXIT_FAILURE
        print(json.dumps(out, indent=2))
        return EXIT_OK
    if not found:
        print(f"nothing fits {_where(args.gpus, hw)} with a {args.margin:.0%} margin; "
              f"smallest change: {change}")
        return EXIT_FAILURE
    if args.emit_launch:
        best = found[0]
        text = launch_script(args.emit_launch, flags(best, model_args, cfg), args.gpus, hw.gpus_per_node,
                             f"{describe(best)}, {best.memory_bytes / GB:.1f} GB per rank, "
                             f"{best.step['step_time_s']:.3g} s per step predicted")
        if not args.emit_path:
            print(text, end="")
            return EXIT_OK
        with open(args.emit_path, "w") as fh:
            fh.write(text)
        os.chmod(args.emit_path, 0o755)
    _print_table(found, cfg, model_args, args.top, args.gpus, hw)
    if args.emit_path:
        print(f"wrote the {args.emit_launch} launch script of layout 1 to {args.emit_path}")
    return EXIT_OK
