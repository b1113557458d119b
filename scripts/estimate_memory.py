#!/usr/bin/env python
"""Estimate per-rank memory for each ZeRO stage: params, grads, optimizer state, activations.

Takes the same flags as pretrain_gpt.py (e.g. --model gpt2-xl --tensor-model-parallel-size 2
--bf16 --micro-batch-size 4) plus --world-size; prints a table, or JSON with --json.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.config import ConfigError, parse_args  # noqa: E402
from megazero.memory import estimate, total_params  # noqa: E402
from models.presets import PRESETS  # noqa: E402


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--world-size", type=int, default=1, help="Number of ranks (GPUs or processes).")
    pre.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    ours, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        pre.print_help()
        print("\nAll pretrain_gpt.py flags are accepted as well (see scripts/pretrain_gpt.py --help).")
        return 0
    if "--mock-data" not in rest and "--data-path" not in rest:
        rest = rest + ["--mock-data"]
    try:
        cfg = parse_args(rest, presets=PRESETS, world_size=ours.world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = estimate(cfg)
    if ours.json:
        print(json.dumps({"total_params": total_params(cfg), "world_size": ours.world_size,
                          "data_parallel_size": cfg.parallel.data_parallel_size, "stages": rows}, indent=2))
        return 0
    gib = 2 ** 30
    par = cfg.parallel
    print(f"model: {total_params(cfg) / 1e6:.1f}M parameters; world {ours.world_size} = "
          f"TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x DP {par.data_parallel_size}; "
          f"{rows[0]['params_per_rank'] / 1e6:.1f}M parameters on the largest rank")
    print(f"{'ZeRO':>4} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} {'activ GiB':>10} {'total GiB':>10}")
    for r in rows:
        print(f"{r['zero_stage']:>4} {r['param_bytes'] / gib:>11.3f} {r['grad_bytes'] / gib:>10.3f} "
              f"{r['optim_bytes'] / gib:>10.3f} {r['activation_bytes'] / gib:>10.3f} {r['total_bytes'] / gib:>10.3f}"
              + ("  (optimizer state in host memory)" if r["optim_on_cpu"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
