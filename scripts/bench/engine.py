#!/usr/bin/env python
"""megazero's engine beside DeepSpeed on the same BERT: ZeRO-2 and ZeRO-3, two data-parallel ranks.

Both frameworks run one loop, this file's ``_train``, under ``torch.distributed.run`` of their own
interpreter: the DeepSpeed modes ``import deepspeed`` (``--ds-python``, a venv with deepspeed and
transformers; DeepSpeed is not a dependency of megazero), the megazero modes
``import megazero.deepspeed as deepspeed``; the model (transformers' ``BertForMaskedLM`` from a random
config, dropout 0, the same seed), the data (random tokens, 15% masked), the ds_config (fp32, AdamW,
clipping, the ZeRO stage; every other key at DeepSpeed's default on both sides) and the timing are
the same.  Per mode: the median step time (forward, backward and ``step()``, barrier to barrier)
after the warm-up steps, and per rank the peak resident memory (``ru_maxrss``) and its growth from
before the model was built (the model, its optimizer state, the activations and the framework's own
buffers); both ranks' figures are printed, with megazero / DeepSpeed ratios measured in the same run.

    python scripts/bench_engine.py --ds-python /work/venv-engine/bin/python          # ~5 minutes on 2 cores
    python scripts/bench_engine.py --modes mz-z3 ds-z3 --iters 10 --json out.json

Setting up DeepSpeed: docs/offload.md ("Against DeepSpeed"); this benchmark needs no compiled op but
DeepSpeed's own CPU communication op, which it builds on first use (a minute).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from megazero.errors import EXIT_OK, EXIT_USAGE

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODES = {"ds-z2": ("deepspeed", 2), "mz-z2": ("megazero", 2), "ds-z3": ("deepspeed", 3),
         "mz-z3": ("megazero", 3)}
RESULT = "ENGINE_BENCH_RESULT "
MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _config(a, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": a.clip_grad, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": a.weight_decay}},
            "zero_optimization": {"stage": stage}}


def _batches(a, rank: int, n: int):
    import torch
    g = torch.Generator().manual_seed(a.seed + 1 + rank)
    out = []
    for _ in range(n):
        tokens = torch.randint(5, a.vocab, (a.micro_batch, a.seq), generator=g)
        masked = torch.rand(a.micro_batch, a.seq, generator=g) < 0.15
        out.append({"input_ids": torch.where(masked, torch.full_like(tokens, 4), tokens),
                    "labels": torch.where(masked, tokens, torch.full_like(tokens, -100))})
    return out


def _train(a, framework: str, stage: int) -> None:
    """One rank of one mode: the same loop for both frameworks (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from transformers import BertConfig, BertForMaskedLM
    if framework == "deepspeed":
        import deepspeed
    else:
        import megazero.deepspeed as deepspeed
    torch.set_num_threads(a.threads)
    deepspeed.init_distributed()
    rank = dist.get_rank()
    before = _rss()
    torch.manual_seed(a.seed)
    model = BertForMaskedLM(BertConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                       num_attention_heads=max(1, a.hidden // 64),
                                       intermediate_size=4 * a.hidden,
                                       max_position_embeddings=a.seq, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0))
    params = sum(p.numel() for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_config(a, stage))
    data = _batches(a, rank, a.warmup + a.iters)
    times, losses = [], []
    for batch in data:
        dist.barrier()
        start = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {"peak_rss": peak, "rss_before_model": before, "losses": losses}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        inner = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO optimizer wraps the basic one
        if framework == "megazero":
            inner = engine.zero.update.optim  # megazero's flat AdamW on this rank's shard
        name = type(inner if inner is not None else optimizer).__name__
        version = getattr(deepspeed, "__version__", None) if framework == "deepspeed" else None
        print(RESULT + json.dumps({"times": times[a.warmup:], "ranks": every, "params": params,
                                   "optimizer": name, "torch": torch.__version__, "deepspeed": version,
                                   "threads": torch.get_num_threads()}), flush=True)
    dist.barrier()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds-python", default="/work/venv-engine/bin/python",
                   help="interpreter with deepspeed and transformers installed")
    p.add_argument("--mz-python", default=sys.executable, help="interpreter with megazero and transformers")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384, help="hidden size; the MLP is 4x, heads of 64")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=2, help="steps not timed")
    p.add_argument("--iters", type=int, default=8, help="steps timed")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (2 ranks)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=1, help="run the modes this many times, in turn (a load "
                   "change on a shared machine then hits every mode); the medians over the runs are shown")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per mode")
    p.add_argument("--json", help="also write the figures as JSON to this path ('-': stdout)")
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    return p


def _run_mode(a, argv: list, name: str) -> dict:
    framework, _ = MODES[name]
    python = a.ds_python if framework == "deepspeed" else a.mz_python
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=ROOT)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), *argv, "--child", name]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        text = (proc.stdout + proc.stderr).strip().splitlines()
        tail = "\n".join([line for line in text if line.startswith("[rank0]:")][-12:] or text[-25:])
        raise SystemExit(f"bench engine: mode {name} failed (exit {proc.returncode}):\n{tail}")
    return dict(json.loads(lines[-1][len(RESULT):]), wall_s=time.perf_counter() - start)


def _check_ds_python(python: str):
    """None when ``python`` imports deepspeed and transformers, else the one-line reason."""
    code = "import deepspeed, transformers"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{python}: {err}"
    if proc.returncode:
        return f"{python} cannot import deepspeed and transformers ({proc.stderr.strip().splitlines()[-1:]})"
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.child:
        if HERE in sys.path:  # run as a file: this folder's modules must not shadow anything
            sys.path.remove(HERE)
        from megazero.engine.process_exit import tear_down_at_exit
        _train(a, *MODES[a.child])
        # DeepSpeed's ranks too: groups destroyed and gloo's workers drained before the interpreter
        # finalises (a finished rank aborted there now and then; megazero.engine.process_exit)
        tear_down_at_exit()
        return EXIT_OK
    if any(MODES[m][0] == "deepspeed" for m in a.modes):
        why = _check_ds_python(a.ds_python)
        if why:
            print(f"bench engine: --ds-python {why}; see docs/offload.md (\"Against DeepSpeed\") to install "
                  "it", file=sys.stderr)
            return EXIT_USAGE
    out = {"load_average_before": os.getloadavg(), "modes": {}, "runs": {name: [] for name in a.modes}}
    for _ in range(a.repeats):
        for name in a.modes:
            out["runs"][name].append(_run_mode(a, argv, name))
    for name, runs in out["runs"].items():
        out["modes"][name] = _merge(runs)
    out["load_average_after"] = os.getloadavg()
    _print(a, out)
    if a.json:
        if os.path.dirname(HERE) not in sys.path:
            sys.path.insert(0, os.path.dirname(HERE))
        from bench import write_json
        write_json(out, a.json)
    return EXIT_OK


def _merge(runs: list) -> dict:
    """One mode's runs as one: the median step time of each run, and of each rank's memory figures."""
    first = dict(runs[0])
    first["step_s"] = statistics.median(statistics.median(r["times"]) for r in runs)
    first["run_step_s"] = [statistics.median(r["times"]) for r in runs]
    first["ranks"] = [{k: (statistics.median(r["ranks"][i][k] for r in runs) if k != "losses"
                           else runs[0]["ranks"][i][k]) for k in runs[0]["ranks"][i]}
                      for i in range(len(runs[0]["ranks"]))]
    return first


def _print(a, out: dict) -> None:
    modes = out["modes"]
    la0, la1 = out["load_average_before"], out["load_average_after"]
    first = next(iter(modes.values()))
    print(f"BertForMaskedLM {a.layers} x {a.hidden} (MLP {4 * a.hidden}, heads {a.hidden // 64 or 1}), vocab "
          f"{a.vocab}, seq {a.seq}, {first['params']:,} parameters; fp32, AdamW lr {a.lr} weight decay "
          f"{a.weight_decay}, clip {a.clip_grad}; DP 2 x micro-batch {a.micro_batch}, {a.threads} thread(s) "
          f"per rank; median of {a.iters} steps after {a.warmup} (median of {a.repeats} runs); "
          f"{os.cpu_count()} CPUs, load average {la0[0]:.1f} before, {la1[0]:.1f} after")
    print(f"{'mode':>6} {'step s':>7} {'peak RSS MiB (rank 0/1)':>24} {'growth MiB':>11}  optimizer  losses")
    for name, r in modes.items():
        peaks = [x["peak_rss"] / MiB for x in r["ranks"]]
        growth = [(x["peak_rss"] - x["rss_before_model"]) / MiB for x in r["ranks"]]
        r["peak_rss_mib"], r["growth_mib"] = max(peaks), max(growth)
        losses = r["ranks"][0]["losses"]
        print(f"{name:>6} {r['step_s']:>7.3f} {peaks[0]:>12.0f} / {peaks[1]:<9.0f} {max(growth):>11.0f}  "
              f"{r['optimizer']}  {losses[0]:.4f} .. {losses[-1]:.4f}")
    for stage in (2, 3):
        ds, mz = modes.get(f"ds-z{stage}"), modes.get(f"mz-z{stage}")
        if ds and mz:
            print(f"ZeRO-{stage}: megazero / DeepSpeed step time {mz['step_s'] / ds['step_s']:.2f}, peak RSS "
                  f"{mz['peak_rss_mib'] / ds['peak_rss_mib']:.2f}, "
                  f"growth {mz['growth_mib'] / ds['growth_mib']:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
