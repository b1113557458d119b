"""``estimate_memory.py``: per-rank memory per component, estimated, measured, or plotted.

- default: a table per ZeRO stage (the pipeline stage that needs most), then every pipeline
  stage under the configured ZeRO stage; ``--json`` prints the same as JSON (``stages``: one row
  per ZeRO stage with ``param_bytes``, ``grad_bytes``, ``optim_bytes``, ``activation_bytes``,
  ``total_bytes`` and the other components of :mod:`megazero.planning.estimate`; ``pipeline_stages``);
- ``--measure``: runs the configuration for ``--iters`` iterations (one process; several forked
  gloo ranks with ``--world-size N``; or each process under torchrun) and prints each component's
  estimate beside the measurement (:mod:`megazero.training.measure`); with ``--json`` per pipeline stage
  ``{component: {"estimate": bytes, "measured": bytes}}``;
- ``--plot FILE.png``: stacked bars per ZeRO stage (parameters, gradients, optimizer state,
  activations, the rest) for the most loaded rank.

The presets and the model provider come from :mod:`megazero_models.cli`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence

from megazero.config import ConfigError, parse_args
from megazero.errors import EXIT_OK, EXIT_USAGE
from megazero.offload.host_memory import rss_bytes
from megazero.planning.estimate import estimate, estimate_stages, peak_rss, total_params

from .. import saved_activations

GIB = 2 ** 30
# measured key for each compared component (estimate key -> measured key)
COMPARED = {"param_bytes": "param_bytes", "grad_bytes": "grad_bytes", "optim_bytes": "optim_bytes",
            "peak_grad_bytes": "peak_grad_bytes", "activation_bytes": "activation_bytes",
            "pipeline_input_bytes": "pipeline_input_bytes"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, description="Estimate (or measure) per-rank memory.")
    p.add_argument("--world-size", type=int, default=None,
                   help="Number of ranks (default: WORLD_SIZE under torchrun, else 1).")
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    p.add_argument("--measure", action="store_true",
                   help="Also run the configuration and print estimate beside measurement.")
    p.add_argument("--iters", type=int, default=2, help="Iterations to run with --measure.")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="Device the estimate is for (default cuda; --measure: the device it runs on).")
    p.add_argument("--plot", metavar="FILE.png", help="Write stacked bars per ZeRO stage to this PNG.")
    return p


def main(argv: Optional[Sequence[str]], presets: Dict[str, dict], model_provider: Callable) -> int:
    pre = _parser()
    ours, rest = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if "-h" in rest or "--help" in rest:
        pre.print_help()
        print("\nAll pretrain_gpt.py flags are accepted as well (see scripts/pretrain_gpt.py --help).")
        return EXIT_OK
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    world = ours.world_size or env_world
    if ours.measure and "--mock-data" not in rest and "--data-path" not in rest:
        rest = rest + ["--mock-data"]  # a measurement runs the model on data
    try:
        if world < 1:
            raise ConfigError(f"--world-size must be a positive integer, got {world}")
        if ours.iters < 1:
            raise ConfigError(f"--iters must be >= 1, got {ours.iters}")
        cfg = parse_args(rest, presets=presets, world_size=world, check_data=ours.measure)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if ours.measure:
        return _measure_main(cfg, ours, world, env_world, model_provider)
    device = ours.device or "cuda"
    rows = _with_rss(estimate(cfg, device, saved=saved_activations), device)
    stages = _with_rss(estimate_stages(cfg, None, device, saved=saved_activations), device)
    if ours.plot:
        plot(rows, ours.plot, _title(cfg, world))
    if ours.json:
        print(json.dumps({"total_params": total_params(cfg), "padded_total_params": total_params(cfg, True),
                          "active_params": total_params(cfg, active=True),
                          "world_size": world, "data_parallel_size": cfg.parallel.data_parallel_size,
                          "expert_model_parallel_size": cfg.moe.expert_model_parallel_size,
                          "expert_data_parallel_size": cfg.moe.expert_data_parallel_size,
                          "device": device, "stages": rows, "pipeline_stages": stages}, indent=2))
        return EXIT_OK
    _print_estimate(cfg, rows, world, device)
    return EXIT_OK


def _experts(cfg) -> str:
    """The expert layout of an MoE model (``""`` for a dense one)."""
    moe = cfg.moe
    if not moe.num_experts:
        return ""
    return (f"; experts: EP {moe.expert_model_parallel_size} x expert TP {moe.expert_tensor_parallel_size} x "
            f"expert DP {moe.expert_data_parallel_size} ({total_params(cfg, active=True) / 1e6:.1f}M "
            "active parameters a token)")


def _with_rss(rows: List[dict], device: str) -> List[dict]:
    """On CPUs, each row's ``peak_rss_bytes``: the rank's peak resident memory, with this process's own
    resident memory now as the runtime (:func:`megazero.planning.estimate.peak_rss`)."""
    if device == "cpu":
        runtime = rss_bytes()
        for r in rows:
            r["peak_rss_bytes"] = peak_rss(r, runtime)
    return rows


def _title(cfg, world: int) -> str:
    par = cfg.parallel
    name = cfg.model_preset or f"{total_params(cfg) / 1e6:.0f}M-parameter GPT"
    cp = f"CP {par.context_parallel_size} x " if par.context_parallel_size > 1 else ""
    ep = f" x EP {cfg.moe.expert_model_parallel_size}" if cfg.moe.expert_model_parallel_size > 1 else ""
    return (f"{name}: TP {par.tensor_model_parallel_size} x {cp}PP {par.pipeline_model_parallel_size} x "
            f"DP {par.data_parallel_size}{ep} ({world} ranks), micro-batch {cfg.training.micro_batch_size}, "
            f"seq {cfg.model.seq_length}")


def _print_estimate(cfg, rows: List[dict], world: int, device: str) -> None:
    par = cfg.parallel
    print(f"model: {total_params(cfg) / 1e6:.1f}M parameters ({total_params(cfg, True) / 1e6:.1f}M with the "
          f"vocabulary padded to {cfg.model.padded_vocab_size}); world {world} = TP "
          f"{par.tensor_model_parallel_size} x "
          f"{f'CP {par.context_parallel_size} x ' if par.context_parallel_size > 1 else ''}"
          f"PP {par.pipeline_model_parallel_size} x DP "
          f"{par.data_parallel_size}{_experts(cfg)}; {rows[0]['params_per_rank'] / 1e6:.1f}M parameters on "
          f"the most loaded rank; estimate for {device}")
    heads = ("params", "grads", "optim", "comm", "zero3", "activ", "pipe", "temp", "total", "host", "nvme")
    rss = device == "cpu"
    heads += ("rss",) if rss else ()
    print(f"{'ZeRO':>4} {'pp':>3} " + " ".join(f"{h:>8}" for h in heads) + "   (GiB per rank)")
    for r in rows:
        vals = [r["param_bytes"], r["grad_bytes"], r["optim_bytes"], r["comm_bytes"],
                r["gathered_param_bytes"], r["activation_bytes"],
                r["pipeline_buffer_bytes"], r["temporary_bytes"], r["total_bytes"], r["host_bytes"],
                r["nvme_bytes"]] + ([r["peak_rss_bytes"]] if rss else [])
        where = {"cpu": "  (optimizer state in host memory)", "nvme": "  (optimizer state on NVMe)"}
        print(f"{r['zero_stage']:>4} {r['pp_rank']:>3} " + " ".join(f"{v / GIB:>8.3f}" for v in vals)
              + where.get(r["optim_device"], "")
              + ("  (parameters on NVMe)" if r["param_device"] == "nvme" else ""))
    print(f"generation: {rows[0]['generation_state_bytes'] / GIB:.3f} GiB on a rank of stage "
          f"{rows[0]['pp_rank']} to decode --micro-batch-size sequences of --seq-length tokens (KV caches, "
          "conv and recurrent states; not in the total)")
    if rss:
        print("rss: a rank's peak resident memory (total + host + this process's own resident memory, "
              f"{rss_bytes() / GIB:.3f} GiB, for the interpreter and libraries)")
    if par.pipeline_model_parallel_size > 1:
        print(f"per pipeline stage at ZeRO {par.zero_stage}: " + ", ".join(
            f"stage {s['pp_rank']} {s['total_bytes'] / GIB:.3f} GiB "
            f"({s['in_flight_micro_batches']} in flight)"
            for s in estimate_stages(cfg, None, device, saved=saved_activations)))


# ---- --measure ---------------------------------------------------------------------------------
def _measure_one(cfg, model_provider, iters: int):
    from megazero.training.measure import measure_rank
    return measure_rank(cfg, model_provider, iters=iters)


def _run_measure(cfg, world: int, env_world: int, model_provider, iters: int) -> Optional[List[dict]]:
    """Every rank's measurement on rank 0 (None on the other ranks under torchrun)."""
    if env_world > 1:  # under torchrun: every process measures itself
        import torch.distributed as dist
        from megazero.training import init_distributed
        created = init_distributed()
        try:
            mine = _measure_one(cfg, model_provider, iters)
            gathered: List[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(gathered, mine)
            return gathered if dist.get_rank() == 0 else None
        finally:
            if created:
                dist.destroy_process_group()
    if world > 1:
        from megazero.process.local_ranks import run_ranks
        return run_ranks(_measure_one, world, cfg, model_provider, iters, timeout=1800.0)
    return [_measure_one(cfg, model_provider, iters)]


def compare(cfg, measured: List[dict], device: str, runtime: int = 0) -> List[dict]:
    """Per pipeline stage ``{"pp_rank", "components": {name: {"estimate", "measured"}}}`` (measured:
    the largest value over the stage's ranks); on CPUs also the peak resident memory, estimated with
    ``runtime`` bytes for the interpreter and libraries."""
    out = []
    for est in estimate_stages(cfg, None, device, saved=saved_activations):
        ranks = [m for m in measured if m["pp_rank"] == est["pp_rank"]]
        comps = {name: {"estimate": int(est[name]), "measured": max(int(m[key]) for m in ranks)}
                 for name, key in COMPARED.items()}
        if est["nvme_bytes"] or any(m.get("nvme_bytes") for m in ranks):  # the NVMe tier, apart
            comps["nvme_bytes"] = {"estimate": int(est["nvme_bytes"]),
                                   "measured": max(int(m.get("nvme_bytes", 0)) for m in ranks)}
        if device == "cpu":  # the whole process: the device is the host
            comps["peak_rss_bytes"] = {"estimate": peak_rss(est, runtime),
                                       "measured": max(int(m["peak_rss_bytes"]) for m in ranks)}
        if "max_memory_allocated" in ranks[0]:
            alloc = max(int(m["max_memory_allocated"]) for m in ranks)
            comps["max_memory_allocated"] = {"estimate": int(est["total_bytes"]), "measured": alloc}
        out.append({"pp_rank": est["pp_rank"], "components": comps})
    return out


def _measure_main(cfg, ours, world: int, env_world: int, model_provider) -> int:
    import torch
    runtime = rss_bytes()  # before the ranks fork from this process (or start beside it)
    measured = _run_measure(cfg, world, env_world, model_provider, ours.iters)
    if measured is None:
        return EXIT_OK
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = compare(cfg, measured, device, runtime)
    if ours.json:
        print(json.dumps({"world_size": world, "device": device, "zero_stage": cfg.parallel.zero_stage,
                          "runtime_bytes": runtime, "stages": rows}, indent=2))
        return EXIT_OK
    print(f"{_title(cfg, world)}; ZeRO {cfg.parallel.zero_stage}; {ours.iters} iterations on {device}")
    for row in rows:
        print(f"pipeline stage {row['pp_rank']}:")
        print(f"  {'component':<22} {'estimate MiB':>13} {'measured MiB':>13} {'ratio':>7}")
        for name, c in row["components"].items():
            ratio = c["estimate"] / c["measured"] if c["measured"] else float("nan")
            print(f"  {name:<22} {c['estimate'] / 2**20:>13.3f} {c['measured'] / 2**20:>13.3f} {ratio:>7.3f}")
        if "max_memory_allocated" in row["components"]:
            c = row["components"]
            known = sum(c[k]["measured"] for k in ("param_bytes", "peak_grad_bytes", "activation_bytes"))
            known += 0 if cfg.parallel.offload_optimizer else c["optim_bytes"]["measured"]
            print(f"  remainder (allocator, temporaries, workspace): "
                  f"{(c['max_memory_allocated']['measured'] - known) / 2**20:.3f} MiB")
    print("peak_grad_bytes: the estimate is an upper bound (no reduction finishing early); "
          "activations: bytes saved for backward, peak over the schedule.")
    return EXIT_OK


# ---- --plot ------------------------------------------------------------------------------------
def plot(rows: List[dict], path: str, title: str) -> None:
    """Stacked bars, one per ZeRO stage: parameters, gradients (+ buffers), optimizer state (device
    part), activations, everything else; GiB per rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [("parameters", lambda r: r["param_bytes"] + r["gathered_param_bytes"]),
             ("gradients", lambda r: r["grad_bytes"] + r["comm_bytes"]),
             ("optimizer state", lambda r: 0 if r["optim_on_cpu"] else r["optim_bytes"]),
             ("activations", lambda r: r["activation_bytes"]),
             ("pipeline buffers + temporaries", lambda r: r["pipeline_buffer_bytes"] + r["temporary_bytes"])]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    x = [f"ZeRO-{r['zero_stage']}" for r in rows]
    bottom = [0.0] * len(rows)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c"]
    for (label, fn), color in zip(parts, colors):
        vals = [fn(r) / GIB for r in rows]
        ax.bar(x, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GiB per rank")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
