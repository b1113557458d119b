"""Console entry points installed by ``pip install``: ``megazero-pretrain`` and
``megazero-estimate-memory`` (the same programs as ``scripts/pretrain_gpt.py`` and
``scripts/estimate_memory.py``)."""
from __future__ import annotations

import sys
from typing import List, Optional


def model_provider(cfg, mesh):
    """This rank's GPT model chunks (one per virtual pipeline stage)."""
    from . import build_chunks
    return build_chunks(cfg, mesh)


def pretrain_main(argv: Optional[List[str]] = None) -> int:
    """Pretrain a GPT model (run under torchrun for several processes)."""
    from megazero.training import main
    from .presets import PRESETS
    return main(sys.argv[1:] if argv is None else argv, model_provider, PRESETS)


def pretrain_entry(argv: Optional[List[str]] = None) -> None:
    """The ``megazero-pretrain`` console script: :func:`pretrain_main`, then the process ends with its
    exit status without the interpreter's finalization (see :func:`megazero.resilience.exit_process`)."""
    from megazero.resilience import exit_process
    exit_process(pretrain_main(argv))


def estimate_memory_main(argv: Optional[List[str]] = None) -> int:
    """Print per-rank memory for each ZeRO stage (``--json`` for machine-readable output)."""
    import argparse
    import json

    from megazero.config import ConfigError, parse_args
    from megazero.memory import estimate, total_params
    from .presets import PRESETS
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False, description="Estimate per-rank memory per ZeRO stage.")
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
          f"TP {par.tensor_model_parallel_size} x PP {par.pipeline_model_parallel_size} x "
          f"DP {par.data_parallel_size}; "
          f"{rows[0]['params_per_rank'] / 1e6:.1f}M parameters on the largest rank")
    print(f"{'ZeRO':>4} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} {'activ GiB':>10} "
          f"{'total GiB':>10}")
    for r in rows:
        print(f"{r['zero_stage']:>4} {r['param_bytes'] / gib:>11.3f} {r['grad_bytes'] / gib:>10.3f} "
              f"{r['optim_bytes'] / gib:>10.3f} {r['activation_bytes'] / gib:>10.3f} "
              f"{r['total_bytes'] / gib:>10.3f}"
              + ("  (optimizer state in host memory)" if r["optim_on_cpu"] else ""))
    return 0
