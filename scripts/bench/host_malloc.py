"""The trainer's step under each ``--host-malloc`` policy: time, page faults, kernel time, peak memory.

``--host-malloc`` sets glibc's thresholds for the whole process (:mod:`megazero.offload.host_memory`), so
the policies cannot share a process: each run is a child process of its own (one rank, one
thread) that builds the one-process layout of ``bench_peers.py`` with that policy, warms up, then
times ``--steps`` steps of the trainer's own step (``megazero.training.loop._step``).  The
children run one after the other, the policies' order rotated from round to round, so a load
change on a shared machine hits every policy alike.  Per policy it prints the median step time,
the minor page faults and the kernel (system) CPU time per step, and the peak resident memory of
the process (VmHWM); the ratio is against ``keep``, which the default ``auto`` picks for this run.

    python scripts/bench_host_malloc.py                 # 3.71M-parameter GPT, 3 rounds, ~2 min on 2 cores
    python scripts/bench_host_malloc.py --hidden-size 1024 --seq-length 512 --rounds 2
    python scripts/bench_host_malloc.py --quick         # a tiny model: checks that everything runs
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
from typing import Dict, List

from bench import write_json
from megazero.errors import EXIT_OK, EXIT_USAGE
from megazero.offload.host_memory import ENVIRONMENT
from megazero.process.threads import rank_thread_env, set_rank_threads

POLICIES = ("keep", "release", "system")  # auto is keep here (one CPU process, ZeRO-0)
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(policy: str, model: dict, steps: int, warmup: int) -> dict:
    """In this process: the trainer's step under ``policy``; one JSON-able row."""
    from bench import peers
    from megazero.offload.host_memory import peak_rss_bytes
    set_rank_threads()
    step = peers._megazero(peers.LAYOUTS["one"], dict(model, host_malloc=policy))[0]
    for _ in range(warmup):
        step()
    times, faults, kernel = [], 0, 0.0
    for _ in range(steps):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults += after.ru_minflt - before.ru_minflt
        kernel += after.ru_stime - before.ru_stime
    return {"policy": policy, "ms": statistics.median(times) * 1e3, "faults": faults / steps,
            "kernel_ms": kernel / steps * 1e3, "peak_mb": peak_rss_bytes() / 2 ** 20}


def _run_child(policy: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", policy, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--model", json.dumps(args.model)]
    env = rank_thread_env(force=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.path.dirname(HERE), env.get("PYTHONPATH")]))
    for name in ENVIRONMENT:  # would override the policy
        env.pop(name, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"the {policy} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--rounds", type=int, default=3, help="processes per policy, in rotated order")
    p.add_argument("--steps", type=int, default=15, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per process first")
    p.add_argument("--hidden-size", type=int, help="the model's hidden size (default 256)")
    p.add_argument("--seq-length", type=int, help="the model's sequence length (default 128)")
    p.add_argument("--quick", action="store_true", help="a tiny model, one round of two steps")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH ('-': stdout)")
    p.add_argument("--child", choices=list(POLICIES), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, json.loads(args.model), args.steps, args.warmup)))
        return EXIT_OK
    if min(args.rounds, args.steps) < 1 or args.warmup < 0:
        print("error: --rounds and --steps must be at least 1, --warmup at least 0", file=sys.stderr)
        return EXIT_USAGE
    from bench.peers import MODEL, QUICK_MODEL
    args.model = dict(QUICK_MODEL if args.quick else MODEL)
    if args.hidden_size:
        args.model.update(hidden_size=args.hidden_size, num_attention_heads=max(1, args.hidden_size // 64))
    if args.seq_length:
        args.model["seq_length"] = args.seq_length
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    load0 = os.getloadavg()
    runs: Dict[str, List[dict]] = {k: [] for k in args.policies}
    for r in range(args.rounds):
        shift = r % len(args.policies)
        for policy in args.policies[shift:] + args.policies[:shift]:
            runs[policy].append(_run_child(policy, args))
            print(f"  round {r + 1}: {policy} {runs[policy][-1]['ms']:.1f} ms", file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    rows = [{"policy": k, **{f: statistics.median(run[f] for run in v)
                             for f in ("ms", "faults", "kernel_ms", "peak_mb")}} for k, v in runs.items()]
    base = next((r["ms"] for r in rows if r["policy"] == "keep"), rows[0]["ms"])
    m = args.model
    print(f"one process, the trainer's step: {m['num_layers']} layers, hidden {m['hidden_size']}, seq "
          f"{m['seq_length']}, vocab {m['vocab_size']}; {args.rounds} processes per policy, {args.steps} "
          f"steps each after {args.warmup}; medians over processes of the per-process medians")
    print(f"load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} after, on {os.cpu_count()} CPUs")
    print(f"{'--host-malloc':14} {'ms/step':>8} {'ratio':>6} {'faults/step':>12} {'kernel ms/step':>15} "
          f"{'peak MB':>8}")
    for r in rows:
        r["ratio"] = r["ms"] / base
        print(f"{r['policy']:14} {r['ms']:8.1f} {r['ratio']:6.2f} {r['faults']:12.0f} {r['kernel_ms']:15.1f} "
              f"{r['peak_mb']:8.0f}")
    if args.json:
        write_json({"model": args.model, "rounds": args.rounds, "steps": args.steps, "rows": rows,
                    "load_average": [load0[0], load1[0]]}, args.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
