#!/usr/bin/env python
"""Plot training curves from --metrics-file JSONL files, several runs overlaid.

    python scripts/plot_metrics.py runs/demo/metrics.jsonl -o curves.png
    python scripts/plot_metrics.py a.jsonl b.jsonl --labels zero1 zero3 -o compare.png

Six panels against the iteration: train loss, eval loss, learning rate, gradient norm, loss scale
and tokens/s; one colour per run, named in the legend (the file name, or --labels).  Rows
without a value (e.g. eval loss between evaluations, the grad norm of a skipped step) are left
out; a file that a resumed run appended to holds each iteration once (the last row wins if not).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # run from a checkout without installing

from megazero.errors import EXIT_OK, EXIT_USAGE  # noqa: E402 - after the path

PANELS = [("loss", "train loss", False), ("eval_loss", "eval loss", False), ("lr", "learning rate", False),
          ("grad_norm", "grad norm", False), ("loss_scale", "loss scale", True),
          ("tokens_per_sec", "tokens/s", False)]


def read_metrics(path: str) -> Dict[int, dict]:
    """``iteration -> row`` of a metrics file (later rows replace earlier ones)."""
    rows: Dict[int, dict] = {}
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{n}: not a JSON line (is this a --metrics-file?)") from None
            if isinstance(row, dict) and isinstance(row.get("iteration"), int):
                rows[row["iteration"]] = row
    if not rows:
        raise ValueError(f"{path}: no rows with an iteration (is this a --metrics-file?)")
    return rows


def series(rows: Dict[int, dict], key: str) -> Tuple[List[int], List[float]]:
    xs, ys = [], []
    for it in sorted(rows):
        v = rows[it].get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(it)
            ys.append(float(v))
    return xs, ys


def plot(runs: List[Tuple[str, Dict[int, dict]]], out: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (key, name, log) in zip(axes.flat, PANELS):
        drawn = False
        for i, (label, rows) in enumerate(runs):
            xs, ys = series(rows, key)
            if xs:
                style = "o-" if len(xs) < 30 else "-"
                ax.plot(xs, ys, style, color=f"C{i}", label=label, markersize=3, linewidth=1.2)
                drawn = True
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if log and drawn:
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, "not in these files", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
        elif len(runs) > 1 or key == "loss":
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="metrics JSONL files (pretrain_gpt.py --metrics-file)")
    p.add_argument("-o", "--output", default="curves.png", help="picture to write (.png, .svg, .pdf)")
    p.add_argument("--labels", nargs="+", help="legend names, one per file (default: the file names)")
    p.add_argument("--title", default="", help="title above the panels")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.files):
        print(f"plot_metrics.py: error: --labels: {len(args.labels)} names for {len(args.files)} files",
              file=sys.stderr)
        return EXIT_USAGE
    labels = args.labels or [os.path.splitext(os.path.basename(f))[0] if sum(
        os.path.basename(g) == os.path.basename(f) for g in args.files) == 1 else f for f in args.files]
    try:
        runs = [(label, read_metrics(f)) for label, f in zip(labels, args.files)]
    except (OSError, ValueError) as err:
        print(f"plot_metrics.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    plot(runs, args.output, args.title)
    print(f"wrote {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
