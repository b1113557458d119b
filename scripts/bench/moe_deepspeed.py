"""megazero's MoE layer against DeepSpeed-MoE's, one process, forward and backward.

Both layers on the same shapes: ``--tokens`` tokens of ``--hidden``, ``--experts`` experts each an
MLP ``hidden -> --ffn -> hidden`` with the tanh GELU and no biases, top-2 routing over a softmax, no
tokens dropped, an auxiliary load-balancing loss added to the output's sum before backward.
megazero's side is ``megazero_models.moe.MoELayer`` (the router, the all-to-all dispatcher at EP 1,
the experts one product each as by default, and again with ``--moe-grouped-gemm``); DeepSpeed's is
``deepspeed.moe.layer.MoE`` (``ep_size=1``, ``k=2``, ``drop_tokens=False``: GShard-style top-2
gating into dense ``[tokens, experts, capacity]`` dispatch and combine tensors whose capacity grows
to the busiest expert, and a Python loop over the experts).
The routings differ in detail (DeepSpeed's second expert is chosen after masking the first, and its
combine weights are renormalised over the two), so this compares two whole layers doing the same
job, not the same arithmetic.

Each side runs in its own interpreter (DeepSpeed is not a dependency: ``--ds-python`` names a
Python that imports it, see docs/performance.md), one thread, ``--rounds`` timed steps after
``--warmup``; the three runs alternate ``--repeats`` times and the medians of their medians are
printed with the ratios to DeepSpeed.

    python scripts/bench_moe_deepspeed.py --ds-python /work/venv-engine/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench import write_json
from megazero.errors import EXIT_OK

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT = "MOE_RESULT "
SIDES = ("megazero", "megazero_grouped", "deepspeed")


def _time(step, rounds: int, warmup: int) -> float:
    """Median seconds of ``step`` over ``rounds`` calls after ``warmup``."""
    from bench.timing import interleaved_rounds
    for _ in range(warmup):
        step()
    return statistics.median(interleaved_rounds({"step": step}, rounds)["step"])


def _megazero(a, grouped: bool) -> float:
    import torch
    from megazero.config import config_from_dict, validate
    from megazero.mesh import ParallelMesh
    from megazero.moe import MoEStats
    from megazero_models.moe import MoELayer
    cfg = validate(config_from_dict(dict(
        mock_data=True, num_layers=1, hidden_size=a.hidden, num_attention_heads=4, seq_length=a.tokens,
        vocab_size=128, add_bias_linear=False, activation="gelu", num_experts=a.experts,
        moe_ffn_hidden_size=a.ffn, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped, hidden_dropout=0.0,
        attention_dropout=0.0)), 1)
    mesh = ParallelMesh.single(torch.device("cpu"))
    stats = MoEStats([0], a.experts, "cpu")
    layer = MoELayer(cfg, mesh, 0, stats)
    x = torch.randn(a.tokens, 1, a.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def step():
        layer(x).sum().backward()  # the router adds its auxiliary loss's gradient in backward
        stats.reset()
    return _time(step, a.rounds, a.warmup)


def _deepspeed(a) -> float:
    import torch
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(a.port)), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    from deepspeed.moe.layer import MoE
    deepspeed.init_distributed(dist_backend="gloo")
    expert = torch.nn.Sequential(torch.nn.Linear(a.hidden, a.ffn, bias=False),
                                 torch.nn.GELU(approximate="tanh"),
                                 torch.nn.Linear(a.ffn, a.hidden, bias=False))
    layer = MoE(hidden_size=a.hidden, expert=expert, num_experts=a.experts, ep_size=1, k=2,
                capacity_factor=1.0, drop_tokens=False)
    x = torch.randn(1, a.tokens, a.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def step():
        out, aux, _ = layer(x)
        (out.sum() + 1e-2 * aux).backward()
    return _time(step, a.rounds, a.warmup)


def _child(a) -> None:
    from megazero.process.threads import set_rank_threads
    set_rank_threads()
    seconds = _deepspeed(a) if a.child == "deepspeed" else _megazero(a, a.child == "megazero_grouped")
    print(RESULT + json.dumps({"seconds": seconds}), flush=True)


def _run(a, side: str, argv) -> float:
    python = a.ds_python if side == "deepspeed" else sys.executable
    from megazero.process.threads import rank_thread_env
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")])
    env = dict(rank_thread_env(os.environ, force=True), PYTHONPATH=path)  # one thread a side
    proc = subprocess.run([python, os.path.abspath(__file__), *argv, "--child", side], capture_output=True,
                          text=True, timeout=1800, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"bench moe deepspeed: the {side} side failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT):])["seconds"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ds-python", default="/work/venv-engine/bin/python",
                   help="a Python that imports deepspeed (not a megazero dependency)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="the two sides in turn, this many times")
    p.add_argument("--port", type=int, default=29533, help="DeepSpeed's one-process rendezvous port")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON ('-': stdout)")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.child:
        _child(a)
        return EXIT_OK
    if a.experts < 2 or a.tokens < 1:
        _parser().error("--experts must be at least 2 (top-2) and --tokens at least 1")
    if not os.path.exists(a.ds_python):
        _parser().error(f"--ds-python {a.ds_python} does not exist: give a Python that imports deepspeed")
    load0 = os.getloadavg()[0]
    runs = {side: [] for side in SIDES}
    for _ in range(a.repeats):
        for side in runs:
            runs[side].append(_run(a, side, argv))
    med = {side: statistics.median(v) for side, v in runs.items()}
    out = {"load_average": [load0, os.getloadavg()[0]], "runs_s": runs, "median_s": med,
           "ratio": med["megazero"] / med["deepspeed"],
           "grouped_ratio": med["megazero_grouped"] / med["deepspeed"]}
    print(f"MoE layer, {a.tokens} tokens x hidden {a.hidden}, {a.experts} experts "
          f"(GELU {a.hidden} -> {a.ffn}), "
          f"top-2, fwd+bwd, one thread; median of {a.rounds} steps, median of {a.repeats} runs; "
          f"load average {load0:.1f} before, {out['load_average'][1]:.1f} after")
    print(f"  megazero {med['megazero'] * 1e3:8.2f} ms (one product per expert, the default)   "
          f"megazero --moe-grouped-gemm {med['megazero_grouped'] * 1e3:8.2f} ms   "
          f"DeepSpeed-MoE {med['deepspeed'] * 1e3:8.2f} ms")
    print(f"  megazero / DeepSpeed {out['ratio']:.2f}   with --moe-grouped-gemm {out['grouped_ratio']:.2f}")
    if a.json:
        write_json(out, a.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
