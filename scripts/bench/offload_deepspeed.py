#!/usr/bin/env python
"""megazero's offload side by side with DeepSpeed's ZeRO-Infinity on one GPT shape, one process, fp32:

  ds-nvme   DeepSpeed ZeRO-3, optimizer and parameters on NVMe (``--ds-python``, DeepSpeedCPUAdam)
  ds-cpu    DeepSpeed ZeRO-3, optimizer and parameters in host memory
  mz-nvme   megazero ZeRO-3, optimizer and parameters on NVMe
  mz-cpu    megazero ZeRO-3, optimizer in host memory (``offload_optimizer_device="cpu"``)

DeepSpeed trains transformers' GPT2LMHeadModel built to the same shape as megazero's GPT (tied
embeddings, learned positions, dropout 0; both parameter counts are printed), with the same AdamW
hyperparameters (weight decay on the matrices and embeddings only, as megazero), gradient clipping
and batch (micro-batches of 1, accumulated to the global batch), on random tokens from a fixed seed.
DeepSpeed is not a dependency of megazero: it runs under another interpreter (``--ds-python``, a venv
with deepspeed and transformers, see docs/offload.md "Against DeepSpeed").

Each mode runs in a subprocess of its own, which reports the median step time after the first
iteration, its own peak RSS (``ru_maxrss``), the largest size of the swap directory seen after a
step, and the bytes the process read from and wrote to storage per step (``/proc/self/io``
``read_bytes`` / ``write_bytes`` deltas around the step, the same method for both frameworks; reads
served from the page cache are not counted, buffered writes are).

    python scripts/bench_offload_deepspeed.py --dir /tmp                # ~5 minutes on 2 cores
    python scripts/bench_offload_deepspeed.py --modes mz-nvme ds-nvme --iters 6 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from megazero.errors import EXIT_OK, EXIT_USAGE

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MODES = {"ds-nvme": ("deepspeed", "nvme"), "ds-cpu": ("deepspeed", "cpu"),
         "mz-nvme": ("megazero", "nvme"), "mz-cpu": ("megazero", "cpu")}
RESULT = "OFFLOAD_DS_RESULT "
SETUP = ("install deepspeed into a venv: python3.11 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install "
         "torch==2.13.0 deepspeed transformers (NVMe also needs apt-get install libaio-dev); "
         "see docs/offload.md")


def _proc_io() -> dict:
    """This process's storage I/O so far (all its threads): read_bytes and write_bytes."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return {"read": out.get("read_bytes", 0), "write": out.get("write_bytes", 0)}


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # removed meanwhile
                pass
    return total


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class _Meter:
    """Per-step wall time, /proc/self/io deltas and the swap directory's size after the step."""

    def __init__(self, swap: str):
        self.swap, self.rows = swap, []

    def measure(self, fn):
        before, start = _proc_io(), time.perf_counter()
        loss = fn()
        elapsed = time.perf_counter() - start
        after = _proc_io()
        self.rows.append({"step_s": elapsed, "read_bytes": after["read"] - before["read"],
                          "write_bytes": after["write"] - before["write"],
                          "swap_bytes": _dir_bytes(self.swap), "loss": float(loss)})

    def report(self, **extra) -> None:
        print(RESULT + json.dumps(dict(extra, rows=self.rows, peak_rss_bytes=_peak_rss())), flush=True)


def _no_decay(name: str, p) -> bool:
    return len(getattr(p, "ds_shape", p.shape)) < 2  # biases, norms: no weight decay (megazero)


def _child_deepspeed(a, device: str, swap: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    largest = max(a.vocab * a.hidden, 4 * a.hidden * a.hidden)  # elements of the largest parameter
    zero = {"stage": 3, "offload_optimizer": {"device": device}, "offload_param": {"device": device},
            # megazero's optimizer sub-group: fp32 master + two moments filling one streaming buffer
            "sub_group_size": a.buffer_mib * MiB // 12}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": a.batch,
           "gradient_clipping": a.clip_grad, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
           "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": a.weight_decay}},
           "zero_optimization": zero}
    if device == "nvme":
        for section in ("offload_optimizer", "offload_param"):
            zero[section]["nvme_path"] = swap
        # one parameter buffer holds the largest parameter (rounded up to 1 Mi elements); every
        # parameter of 1 MiB or more in use or prefetched holds one, so prefetch one layer ahead and
        # keep at most the largest parameter and two layers live (DeepSpeed's defaults, 5e7 and 1e9
        # elements, prefetch the whole model and run out of its buffers: "Not enough buffers")
        layer = 12 * a.hidden * a.hidden + 13 * a.hidden
        zero["offload_param"].update(buffer_size=-(-largest // MiB) * MiB, buffer_count=a.ds_param_buffers)
        zero.update(stage3_prefetch_bucket_size=layer, stage3_max_live_parameters=largest + 2 * layer)
        # DeepSpeed's default (1e9 elements) swaps every parameter of a smaller model back into host
        # memory for good at start (stage3.py _create_param_groups_fp16_flat_cpu_memory); 0 keeps them
        # on NVMe, as megazero's offload_param_device="nvme" does
        zero["offload_param"]["max_in_cpu"] = a.ds_max_in_cpu
        # megazero's NVMe defaults: 1 MiB requests, 4 I/O threads = 4 requests in flight
        cfg["aio"] = {"block_size": a.block_mib * MiB, "queue_depth": a.io_threads,
                      "intra_op_parallelism": a.io_threads, "single_submit": False, "overlap_events": True}
    torch.manual_seed(a.seed)
    gpt = GPT2Config(vocab_size=a.vocab, n_positions=a.seq, n_embd=a.hidden, n_layer=a.layers, n_head=a.heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(gpt)  # (built inside zero.Init, transformers 5 leaves its weights uninitialised)
    # partitioned here by zero.Init with the config, so in the config's dtype (fp32).  Left to
    # deepspeed.initialize, they are converted with dtype=float32 passed explicitly, which
    # partition_parameters.py's _set_dtype turns into bf16 on CPU (operator precedence,
    # is_fp16_supported() returning None): NVMe-offloaded parameters are then stored at bf16
    if not a.ds_no_zero_init:
        deepspeed.zero.Init(module=model, config_dict_or_path=cfg, remote_device=device, pin_memory=True)
    # tied: the shared embedding counted once; ds_numel: the full size of a partitioned parameter
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": a.weight_decay},
              {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0}]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    inner = type(getattr(optimizer, "optimizer", optimizer)).__name__
    gen = torch.Generator().manual_seed(a.seed + 1)
    meter = _Meter(swap)

    def step():
        losses = []
        for _ in range(a.batch):
            tokens = torch.randint(0, a.vocab, (1, a.seq), generator=gen)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()  # applies the update at the accumulation boundary only
            losses.append(loss.item())
        return sum(losses) / len(losses)

    for _ in range(a.iters):
        meter.measure(step)
    meter.report(params=params, optimizer=inner, threads=torch.get_num_threads(), config=cfg,
                 versions={"deepspeed": deepspeed.__version__, "torch": torch.__version__})


def _child_megazero(a, device: str, swap: str) -> None:
    import torch

    import megazero.training.loop as training
    import megazero_models as models
    from bench.offload import _cfg
    extra = dict(offload_optimizer_device=device, nvme_block_size=a.block_mib * MiB)
    if device == "nvme":
        extra["offload_param_device"] = "nvme"
    cfg = _cfg(a, swap, extra)
    meter, seen, original = _Meter(swap), {}, training._step

    def step(cfg, chunks, optimizer, *args, **kw):
        seen["params"] = optimizer.num_parameters()
        out = []
        meter.measure(lambda: out.append(original(cfg, chunks, optimizer, *args, **kw)) or out[0][2])
        return out[0]

    training._step = step
    try:
        training.train(cfg, models.build_chunks, stream=open(os.devnull, "w"))
    finally:
        training._step = original
    meter.report(params=seen.get("params"), optimizer="megazero ZeroOptimizer",
                 threads=torch.get_num_threads(),
                 config={"weight_decay": cfg.optimizer.weight_decay, "clip_grad": cfg.optimizer.clip_grad,
                         "offload": extra, "nvme_buffer_size": a.buffer_mib * MiB,
                         "nvme_io_threads": a.io_threads})


def _check_ds_python(python: str) -> str | None:
    """None when ``python`` imports deepspeed and transformers, else the one-line reason."""
    code = ("import importlib, sys\nfor m in ('deepspeed', 'transformers'):\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as e:\n"
            "        sys.exit(f'{m}: {type(e).__name__}: {e}'.splitlines()[0])\n")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{python}: {err}"
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
        return f"{python} cannot import it ({last})"
    return None


def _summary(res: dict) -> dict:
    rows = res["rows"][1:] or res["rows"]  # the first iteration also warms up
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "read_bytes", "write_bytes")}
    return dict(med, swap_bytes=max(r["swap_bytes"] for r in res["rows"]),
                peak_rss_bytes=res["peak_rss_bytes"], params=res["params"], optimizer=res["optimizer"],
                threads=res["threads"],
                losses=[r["loss"] for r in res["rows"]], config=res["config"],
                versions=res.get("versions"), wall_s=res["wall_s"])


def _parser() -> argparse.ArgumentParser:
    if os.path.join(ROOT, "scripts") not in sys.path:  # the bench package, also when run as a file
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench.offload import add_model_args
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)  # the same GPT, batch and iterations as bench_offload.py
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python",
                   help="interpreter with deepspeed and transformers installed")
    p.add_argument("--mz-python", default=sys.executable, help="interpreter with megazero installed")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01, help="megazero's default")
    p.add_argument("--clip-grad", type=float, default=1.0, help="megazero's default")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--buffer-mib", type=int, default=64,
                   help="megazero --nvme-buffer-size (MiB); DeepSpeed's sub_group_size is set to the "
                   "elements of fp32 master + 2 moments that fill one")
    p.add_argument("--block-mib", type=int, default=1, help="I/O request size, both frameworks")
    p.add_argument("--io-threads", type=int, default=4, help="megazero --nvme-io-threads; DeepSpeed aio "
                   "queue_depth and intra_op_parallelism")
    p.add_argument("--ds-max-in-cpu", type=int, default=0, help="DeepSpeed offload_param max_in_cpu "
                   "(elements kept in host memory with parameters on NVMe; DeepSpeed's default is 1e9)")
    p.add_argument("--ds-param-buffers", type=int, default=40, help="DeepSpeed offload_param "
                   "buffer_count (each holds the largest parameter)")
    p.add_argument("--ds-no-zero-init", action="store_true", help="build DeepSpeed's model outside "
                   "deepspeed.zero.Init (its parameters then offload at bf16, see docs/offload.md)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--timeout", type=float, default=1200, help="seconds per mode")
    p.add_argument("--json", help="also write the figures as JSON to this path ('-': stdout)")
    p.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--swap", help=argparse.SUPPRESS)
    return p


def _run_child(a, argv: list, name: str) -> dict:
    framework, _ = MODES[name]
    python = a.ds_python if framework == "deepspeed" else a.mz_python
    swap = tempfile.mkdtemp(prefix=f"bench_offload_{name}_", dir=a.dir)
    start = time.perf_counter()
    try:
        proc = subprocess.run([python, os.path.abspath(__file__), *argv, "--child", name, "--swap", swap],
                              capture_output=True, text=True, timeout=a.timeout)
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise SystemExit(f"offload_deepspeed: mode {name} failed (exit {proc.returncode}):\n{tail}")
    return dict(json.loads(lines[-1][len(RESULT):]), wall_s=wall)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.child:
        if HERE in sys.path:  # run as a file: its folder's modules (offload, zero, ...) shadow nothing
            sys.path.remove(HERE)
        framework, device = MODES[a.child]
        (_child_deepspeed if framework == "deepspeed" else _child_megazero)(a, device, a.swap)
        return EXIT_OK
    if any(MODES[m][0] == "deepspeed" for m in a.modes):
        why = _check_ds_python(a.ds_python)
        if why:
            print(f"offload_deepspeed: --ds-python {why}; {SETUP}", file=sys.stderr)
            return EXIT_USAGE
    out = {"load_average_before": os.getloadavg(), "modes": {}}
    for name in a.modes:
        out["modes"][name] = _summary(_run_child(a, argv, name))
    out["load_average_after"] = os.getloadavg()
    _print(a, out)
    if a.json:
        from bench import write_json
        write_json(out, a.json)
    return EXIT_OK


def _print(a, out: dict) -> None:
    modes = out["modes"]
    la0, la1 = out["load_average_before"], out["load_average_after"]
    print(f"GPT {a.layers} x {a.hidden}, heads {a.heads}, seq {a.seq}, vocab {a.vocab}, batch {a.batch} "
          f"(micro-batches of 1), fp32, ZeRO-3, one process, {a.iters} iterations, AdamW lr {a.lr} "
          f"betas 0.9/0.999 eps 1e-8 weight decay {a.weight_decay}, clip {a.clip_grad}; "
          f"NVMe: {a.block_mib} MiB requests, {a.io_threads} in flight; {os.cpu_count()} CPUs; "
          f"load average (1 min) {la0[0]:.1f} before, {la1[0]:.1f} after")
    for name, r in modes.items():
        print(f"  {name}: {r['params']:,} parameters, optimizer {r['optimizer']}, "
              f"torch threads {r['threads']}"
              + (f", {r['versions']}" if r.get("versions") else ""))
    print(f"{'mode':>8} {'step s':>7} {'read MB/step':>13} {'write MB/step':>14} {'swap dir MB':>12} "
          f"{'peak RSS MiB':>13} {'wall s':>7}  losses")
    for name, r in modes.items():
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        print(f"{name:>8} {r['step_s']:>7.2f} {r['read_bytes'] / 1e6:>13.0f} {r['write_bytes'] / 1e6:>14.0f} "
              f"{r['swap_bytes'] / 1e6:>12.0f} {r['peak_rss_bytes'] / MiB:>13.0f} {r['wall_s']:>7.0f}  "
              f"{losses}")


if __name__ == "__main__":
    raise SystemExit(main())
