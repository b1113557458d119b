#!/usr/bin/env python
"""oneDNN against PyTorch's BLAS on a model's own fp32 CPU products, and what ``--cpu-matmul auto``
chooses from them.

Takes the trainer's model and layout flags (``--model``, ``--hidden-size``, ``--seq-length``,
``--micro-batch-size``, ``--tensor-model-parallel-size`` ...), lists one rank's linear products
(:func:`megazero.tensor_parallel.cpu_matmul.linear_products`), times the forward and the input
gradient of each through both libraries with the same measurement ``auto`` makes at start-up
(fresh, not from the cache), on one intra-op thread, and prints each product's time per step
(scaled to its row count and number of layers), the ratio oneDNN / BLAS (below 1: oneDNN faster),
the same ratio for the forward and for the transposed input-gradient product alone, the totals and
the choice.  Products under ``ONEDNN_MIN_MACS`` are listed too (``auto`` never sends them to
oneDNN), so the threshold can be checked on a new CPU (``--micro-batch-size`` and
``--seq-length`` move the row count across it).  Run it at idle.

    python scripts/bench_matmul.py --hidden-size 1024 --seq-length 512
    python scripts/bench_matmul.py --model gpt2-small --micro-batch-size 4 --json out.json
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        python scripts/bench_matmul.py --hidden-size 1024 --seq-length 512   # AVX2 kernels on AVX-512
"""
from __future__ import annotations

import argparse
import sys

from bench import write_json
from megazero.errors import EXIT_OK, EXIT_USAGE


def main(argv=None) -> int:
    from megazero.config import ConfigError, build_parser, parse_args, validate
    from megazero_models import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False,
                                epilog="Every other flag is the trainer's (model and layout).")
    p.add_argument("--reps", type=int, default=5,
                   help="timed calls per product and library (the fastest counts)")
    p.add_argument("--json", metavar="PATH", help="write the rows and totals as JSON to PATH ('-': stdout)")
    args, rest = p.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:  # this script's flags, then the trainer's
        p.print_help()
        build_parser(PRESETS).print_help()
        return EXIT_OK
    from megazero.tensor_parallel import cpu_matmul as cm
    from megazero.tensor_parallel.layers import ONEDNN_MIN_MACS, onednn_linear_available
    from megazero.process.threads import set_rank_threads
    try:
        cfg = parse_args(rest + ["--mock-data"], PRESETS, validate_now=False)
        par = cfg.parallel
        cfg = validate(cfg, par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                       * par.context_parallel_size, check_data=False)
    except ConfigError as err:
        print(f"bench_matmul.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if not onednn_linear_available():
        print("bench_matmul.py: error: this torch build has no oneDNN linear (an x86 CPU build is "
              "needed)", file=sys.stderr)
        return EXIT_USAGE
    set_rank_threads()
    products = cm.linear_products(cfg, par.tensor_model_parallel_size, par.context_parallel_size)
    rows, total = [], {"onednn": 0.0, "torch": 0.0}
    print(f"# {cm.machine_key()}")
    print("rows x out x in (layers) | MACs | oneDNN ms | BLAS ms | oneDNN / BLAS: all, forward, input "
          "grad | measured by auto")
    for prod in products:
        detail: dict = {}
        s = cm.measure([prod], reps=args.reps, detail=detail)
        ratio = {d: detail["onednn", d] / detail["torch", d] for d in ("forward", "input grad")}
        big = prod.macs >= ONEDNN_MIN_MACS
        rows.append({"rows": prod.rows, "out": prod.out, "inp": prod.inp, "count": prod.count,
                     "macs": prod.macs, "onednn_s": s["onednn"], "torch_s": s["torch"], "measured": big,
                     "ratio_forward": ratio["forward"], "ratio_input_grad": ratio["input grad"]})
        if big:
            total = {k: total[k] + s[k] for k in total}
        print(f"{prod.rows} x {prod.out} x {prod.inp} ({prod.count}) | {prod.macs / 1e6:.1f}M | "
              f"{s['onednn'] * 1e3:.2f} | {s['torch'] * 1e3:.2f} | {s['onednn'] / s['torch']:.3f}, "
              f"{ratio['forward']:.3f}, {ratio['input grad']:.3f} | "
              f"{'yes' if big else 'no (under ONEDNN_MIN_MACS)'}")
    if total["torch"]:
        choice = "onednn" if cm.decide(total) else "torch"
        print(f"measured products: oneDNN {total['onednn'] * 1e3:.2f} ms, BLAS "
              f"{total['torch'] * 1e3:.2f} ms, ratio {total['onednn'] / total['torch']:.3f}: auto chooses "
              f"{choice}")
    else:
        choice = None
        print("no product reaches ONEDNN_MIN_MACS: auto changes nothing for this model")
    if args.json:
        write_json({"machine": cm.machine_key(), "rows": rows, "total": total, "auto": choice}, args.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
