#!/usr/bin/env python
"""Checkpoint save/load time and peak extra host memory: megazero vs torch.distributed.checkpoint.

    python scripts/bench_checkpoint.py                      # this checkout, GPT-2 (124M), 4 ranks, ZeRO-2
    python scripts/bench_checkpoint.py --repo /path/to/old  # the same measurement, another checkout's code
    python scripts/bench_checkpoint.py --async-steps        # step time with and without --async-save

Every rank builds the model and a ZeRO optimizer (Adam moments filled with random values), then
for each method: save, then load back into freshly zeroed state, checking the values round-trip.
Peak extra memory is each rank's high-water resident set size (``VmHWM``, reset through
``/proc/self/clear_refs`` before each operation, Linux only) minus its resident size before it;
the table shows the largest rank.  Methods:

* ``megazero``: :func:`megazero.checkpoint.save` / :func:`load` of the imported checkout (reshardable);
* ``dcp``: ``torch.distributed.checkpoint.save``/``load`` of the same optimizer state as DTensors
  sharded over the data-parallel ranks (also reshardable), one file per rank; after loading, the
  parameters are republished from the loaded shards (the all-gather megazero's load also does).

The page cache is warm (the load follows the save).  Numbers are printed, never asserted.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=ROOT, help="checkout whose megazero is measured (default: this one)")
    p.add_argument("--model", default="gpt2-small", help="model preset (default gpt2-small, 124M parameters)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--methods", nargs="+", default=["megazero", "dcp"], choices=["megazero", "dcp"])
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--async-steps", action="store_true",
                   help="instead: step time with and without --async-save (scripts/bench/async_save.py)")
    p.add_argument("--layers", type=int, default=4, help="--async-steps: layers")
    p.add_argument("--hidden", type=int, default=768, help="--async-steps: hidden size")
    p.add_argument("--iters", type=int, default=40, help="--async-steps: iterations")
    p.add_argument("--save-interval", type=int, default=10, help="--async-steps: iterations between saves")
    return p.parse_args()


def _status(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _measured(fn):
    """``(seconds, peak extra bytes)`` of ``fn()`` on this process."""
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, _status("VmHWM") - before


def _build(args):
    import torch
    import models
    from megazero.config import config_from_dict, validate
    from megazero.training import build_mesh
    from megazero.zero import build_optimizer
    settings = {"model_preset": args.model, "mock_data": True, "seq_length": 64, "micro_batch_size": 1,
                "zero_stage": args.zero_stage, "optimizer": "adam"}
    if args.model.startswith("gpt2"):
        settings["vocab_size"] = 50304  # a multiple of 128: no padded rows (loading zeroes those by design)
    cfg = validate(config_from_dict(settings, models.PRESETS), args.ranks)
    mesh = build_mesh(cfg)
    chunks = models.build_chunks(cfg, mesh)
    opt = build_optimizer(chunks, mesh, cfg)
    gen = torch.Generator().manual_seed(mesh.rank)
    for state in opt.update.state.values():
        for t in state.values():
            t.copy_(torch.rand(t.shape, generator=gen))
    return cfg, mesh, chunks, opt


def _snapshot(opt):
    return [t.clone() for t in opt.update.tensors()]


def _zero(opt):
    import torch
    with torch.no_grad():
        for t in opt.update.tensors():
            t.zero_()


def _dcp_state(opt, mesh):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    dp = DeviceMesh("cpu", mesh.ranks("dp"))
    out = {}
    for b in opt.buckets:
        tensors = {"master": opt.update.master[b.index], **opt.update.state[b.index]}
        for k, t in tensors.items():
            name = f"tp{mesh.coord('tp')}.pp{mesh.coord('pp')}.b{b.index}.{k}"
            out[name] = DTensor.from_local(t, dp, [Shard(0)], run_check=False)
    return out


def _dcp_load(state, where, opt):
    """DCP fills the shards in place; the parameters are then republished from them (the all-gather
    that megazero's load also does), so both columns time a usable model."""
    import torch.distributed.checkpoint as dcp
    dcp.load(state, checkpoint_id=where)
    for b in opt.buckets:
        opt.publish_params(b)


def _run_rank(args, directory):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megazero.checkpoint import load, save
    cfg, mesh, chunks, opt = _build(args)
    expect = _snapshot(opt)
    params = sum(p.numel() for b in opt.buckets for p in b.params)
    shard = sum(t.numel() * t.element_size() for t in opt.update.tensors())
    results = {"params": params, "shard_bytes": shard, "rss": _status("VmRSS")}
    for method in args.methods:
        where = os.path.join(directory, method)
        dist.barrier()
        if method == "megazero":
            save_s, save_mem = _measured(lambda: save(where, 1, chunks, opt, mesh, cfg))
            _zero(opt)
            dist.barrier()
            load_s, load_mem = _measured(lambda: load(where, chunks, opt, mesh, cfg))
        else:
            state = _dcp_state(opt, mesh)
            save_s, save_mem = _measured(lambda: dcp.save(state, checkpoint_id=where))
            _zero(opt)
            dist.barrier()
            load_s, load_mem = _measured(lambda: _dcp_load(state, where, opt))
        same = all(torch.equal(a, b) for a, b in zip(expect, opt.update.tensors()))
        results[method] = dict(save_s=save_s, save_mem=save_mem, load_s=load_s, load_mem=load_mem, same=same)
        dist.barrier()
    return results


def main():
    args = parse()
    sys.path.insert(0, args.repo)
    from megazero.process.threads import rank_thread_env
    os.environ.update(rank_thread_env())  # for the ranks it forks
    if args.async_steps:
        from bench.async_save import async_steps
        return async_steps(args)
    from megazero.process.local_ranks import run_ranks
    directory = args.dir or tempfile.mkdtemp(prefix="megazero-bench-ckpt-")
    try:
        ranks = run_ranks(_run_rank, args.ranks, args, directory, timeout=args.timeout)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    mib = 2.0 ** 20
    r0 = ranks[0]
    print(f"{args.model}: {r0['params'] / 1e6:.1f}M parameters, {args.ranks} ranks, ZeRO-{args.zero_stage}, "
          f"code from {args.repo}; optimizer state per rank {r0['shard_bytes'] / mib:.0f} MiB "
          f"(master + Adam moments), resident before {r0['rss'] / mib:.0f} MiB")
    print(f"{'method':<10} {'save s':>8} {'save peak MiB':>14} "
          f"{'load s':>8} {'load peak MiB':>14}  round trip")
    for method in args.methods:
        rows = [r[method] for r in ranks]
        print(f"{method:<10} {max(x['save_s'] for x in rows):>8.2f} "
              f"{max(x['save_mem'] for x in rows) / mib:>14.0f} "
              f"{max(x['load_s'] for x in rows):>8.2f} {max(x['load_mem'] for x in rows) / mib:>14.0f}  "
              f"{'exact' if all(x['same'] for x in rows) else 'DIFFERS'}")
    from megazero.errors import EXIT_OK
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
