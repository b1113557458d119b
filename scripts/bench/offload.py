#!/usr/bin/env python
"""Offload side by side on one model that fits in memory: the same training run in memory, with the
optimizer in host memory, with the optimizer on NVMe, and with the optimizer and the ZeRO-3
parameters on NVMe (measured, never asserted).

Each mode runs ``--iters`` iterations in a process of its own (forked, so its peak RSS is its own)
and reports the median step time after the first iteration, the I/O wait per step and its share of
the step, bytes read and written per step, the disk bandwidth averaged over the step (bytes moved /
step time) and while streaming (bytes moved / the time at least one request was in service,
``io_busy_s``) next to the disk's peak measured in the same run (simultaneous direct reads and
writes, as :mod:`bench.nvme_io` measures them), and the peak RSS.

    python scripts/bench_offload.py --dir /tmp                      # GPT 8 x 512, ZeRO-3, ~2 minutes
    python scripts/bench_offload.py --dir /mnt/nvme --layers 12 --hidden 768 --iters 4 --json out.json

The swap files live under ``--dir`` for the run and are removed after it.  ``--ranks N`` trains at
DP N (N forked ranks; the peak RSS is the largest rank's); ``--experts E --moe-ffn F`` makes every layer
an MoE layer of ``E`` experts of hidden size ``F`` (``--ffn E x F``: a dense model with as many
parameters, but the routers').  MoE against dense at ZeRO-3 DP 2, both NVMe tiers (docs/moe.md):

    python scripts/bench_offload.py --modes nvme-optimizer+params --ranks 2 --experts 16 --moe-ffn 1024
    python scripts/bench_offload.py --modes nvme-optimizer+params --ranks 2 --ffn 16384
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from megazero.errors import EXIT_OK

MiB = 1 << 20
MODES = {"memory": {}, "cpu": dict(offload_optimizer_device="cpu"),
         "nvme-optimizer": dict(offload_optimizer_device="nvme"),
         "nvme-optimizer+params": dict(offload_optimizer_device="nvme", offload_param_device="nvme")}


def _cfg(a, swap: str, extra: dict):
    from megazero.config import config_from_dict
    settings = dict(mock_data=True, num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                    seq_length=a.seq, vocab_size=a.vocab, micro_batch_size=1, global_batch_size=a.batch,
                    train_iters=a.iters, optimizer="adam", lr=1e-4, zero_stage=3, log_interval=10 ** 6,
                    hidden_dropout=0.0, attention_dropout=0.0, nvme_path=swap,
                    nvme_buffer_size=a.buffer_mib * MiB, nvme_io_threads=a.io_threads)
    settings.update(extra)
    return config_from_dict(settings)


def _run_mode(a, swap: str, extra: dict) -> list:
    import megazero_models as models  # the installed models package (scripts/ is not beside it)
    from megazero.offload.host_memory import reset_peak_rss
    from megazero.training import train
    reset_peak_rss()  # a forked rank starts from its parent's high-water mark
    return train(_cfg(a, swap, extra), models.build_chunks, stream=open(os.devnull, "w"))


def _summary(history: list, peak_bw: float) -> dict:
    rows = history[1:] or history  # the first iteration also warms up
    step = statistics.median(m["iteration_time"] for m in rows)
    read = statistics.median(m.get("io_read_bytes", 0) for m in rows)
    written = statistics.median(m.get("io_write_bytes", 0) for m in rows)
    wait = statistics.median(m.get("io_wait_s", 0.0) for m in rows)
    busy = statistics.median(m.get("io_busy_s", 0.0) for m in rows)
    bw = (read + written) / step if step else 0.0
    streaming = (read + written) / busy if busy else 0.0
    return {"step_s": step, "io_wait_s": wait, "io_wait_share": wait / step if step else 0.0,
            "read_bytes": read, "written_bytes": written, "disk_bytes_per_s": bw,
            "io_busy_s": busy, "streaming_bytes_per_s": streaming,
            "of_peak": streaming / peak_bw if peak_bw else 0.0,
            "peak_rss_bytes": max(m["peak_rss_bytes"] for m in history),
            "losses": [m["loss"] for m in history]}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The swap directory, the GPT's shape, the batch and the iterations (this bench's and
    :mod:`bench.offload_deepspeed`'s)."""
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk for the swap files")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2, help="global batch (micro-batches of 1)")
    p.add_argument("--iters", type=int, default=4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--buffer-mib", type=int, default=64, help="--nvme-buffer-size, MiB")
    p.add_argument("--io-threads", type=int, default=4, help="--nvme-io-threads")
    p.add_argument("--peak-mib", type=int, default=256, help="bytes of the disk's peak measurement")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (forked processes)")
    p.add_argument("--ffn", type=int, help="--ffn-hidden-size (default 4 x --hidden)")
    p.add_argument("--experts", type=int, default=0, help="--num-experts, every layer an MoE layer")
    p.add_argument("--moe-ffn", type=int, help="--moe-ffn-hidden-size (default --ffn)")
    p.add_argument("--json", help="also write the figures as JSON to this path ('-': stdout)")
    a = p.parse_args(argv)
    from bench import write_json
    from bench.nvme_io import make_file, mixed_bandwidth
    from megazero.process.local_ranks import run_ranks
    swap = tempfile.mkdtemp(prefix="bench_offload_", dir=a.dir)
    raw = os.path.join(swap, "peak.bin")
    try:
        make_file(raw, a.peak_mib * MiB)
        peak = max(mixed_bandwidth(raw, a.peak_mib * MiB, MiB, a.io_threads, flip=f) for f in (False, True))
        os.unlink(raw)
        out = {"peak_disk_bytes_per_s": peak, "modes": {}}
        shape = {"ffn_hidden_size": a.ffn} if a.ffn else {}
        if a.experts:
            shape.update(num_experts=a.experts, moe_ffn_hidden_size=a.moe_ffn)
        for name in a.modes:
            ranks = run_ranks(_run_mode, a.ranks, a, swap, dict(MODES[name], **shape), timeout=3600)
            out["modes"][name] = _summary(ranks[0], peak)
            out["modes"][name]["peak_rss_bytes"] = max(max(m["peak_rss_bytes"] for m in h) for h in ranks)
    finally:
        for f in os.listdir(swap):
            os.unlink(os.path.join(swap, f))
        os.rmdir(swap)
    ffn = a.ffn or 4 * a.hidden
    mlp = f"{a.experts} experts of {a.moe_ffn or ffn}" if a.experts else f"ffn {ffn}"
    print(f"GPT {a.layers} x {a.hidden}, {mlp}, seq {a.seq}, batch {a.batch}, "
          f"ZeRO-3, {a.ranks} rank(s) (DP); disk peak "
          f"(direct reads + writes at once, 1 MiB x {a.io_threads} threads): {peak / 1e6:.0f} MB/s; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':>22} {'step s':>8} {'vs mem':>7} {'I/O wait':>9} {'read MB':>8} {'write MB':>9} "
          f"{'disk MB/s':>10} {'streaming':>10} {'of peak':>8} {'peak RSS MiB':>13}")
    base = out["modes"].get("memory", {}).get("step_s")
    for name, r in out["modes"].items():
        rel = f"{r['step_s'] / base:.2f}x" if base else "-"
        print(f"{name:>22} {r['step_s']:>8.2f} {rel:>7} {100 * r['io_wait_share']:>8.0f}% "
              f"{r['read_bytes'] / 1e6:>8.0f} {r['written_bytes'] / 1e6:>9.0f} "
              f"{r['disk_bytes_per_s'] / 1e6:>10.0f} {r['streaming_bytes_per_s'] / 1e6:>10.0f} "
              f"{100 * r['of_peak']:>7.0f}% {r['peak_rss_bytes'] / MiB:>13.0f}")
    if a.json:
        write_json(out, a.json)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
