#!/usr/bin/env python
"""Disk bandwidth for NVMe offload: the disk's peak next to what :class:`megazero.offload.NvmeStore`
achieves while streaming an optimizer step (measured, never asserted).

(a) Peak: sequential ``O_DIRECT`` writes, then reads, of one file with ``os.pwrite``/``os.preadv``
    from a thread pool, for every block size and thread count asked (like ``fio --direct=1
    --rw=write/read --bs=B --numjobs=T``); optionally ``dd bs=4M oflag/iflag=direct`` beside it.
(b) The store: ``--state-mib`` of fp32 optimizer state (master, two moments) in sub-groups of
    ``--subgroup-mib``, in interleaved rounds (a shared disk's load hits every mode alike) of:
    "disk", a raw pass writing half and reading half of a file as large as the state, at the best
    (block, threads) of (a); "I/O only", the store's streamed step without an update (its own
    bandwidth); "streamed", with a small Adam-like update (the overlap); "synchronous", a plain
    read-update-write loop.  Printed per step: time, bytes, bandwidth and its ratio to "disk" in
    the same round, the fraction of the step spent waiting on I/O, CPU seconds per GB moved.
(c) What the blocks' checksums cost: the "I/O only" step with the store's checksum (XXH3), with
    zlib's CRC32 instead and with none, interleaved; each as a ratio to the step without.

    python scripts/bench_nvme_io.py --dir /tmp            # ~2 minutes, at most ~2 GiB of files
    python scripts/bench_nvme_io.py --dir /mnt/nvme --blocks 1 4 --threads 4 8 --state-mib 2048

The files (about twice ``--state-mib``) are removed at the end.  docs/offload.md records the
figures of this machine.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from megazero.errors import EXIT_OK
from megazero.offload import IOCounts, NvmeStore, Streamer, aligned_empty
from megazero.offload.aligned import byte_view
from megazero.process.threads import set_rank_threads
from bench.timing import interleaved_rounds

MiB = 1 << 20


def raw_bandwidth(path: str, file_bytes: int, block: int, threads: int, write: bool) -> float:
    """Bytes per second of one sequential pass over ``path`` in ``block``-byte direct requests,
    ``threads`` of them in flight."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    bufs = [aligned_empty(block) for _ in range(threads)]
    for b in bufs:
        b.fill_(7)
    views = [byte_view(b) for b in bufs]
    offsets = list(range(0, file_bytes, block))

    def stripe(i):  # thread i moves every threads-th block
        mv = views[i]
        for off in offsets[i::threads]:
            done = os.pwrite(fd, mv, off) if write else os.preadv(fd, [mv], off)
            assert done == block, (done, block)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(stripe, range(threads)))
        if write:
            os.fsync(fd)
        return len(offsets) * block / (time.perf_counter() - start)
    finally:
        os.close(fd)


def dd_bandwidth(path: str, count_4m: int) -> dict:
    """``dd`` write then read of ``count_4m`` x 4 MiB with direct I/O, in bytes per second."""
    out = {}
    for kind, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct"]),
                       ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        done = subprocess.run(["dd", "bs=4M", f"count={count_4m}"] + args, capture_output=True, text=True)
        m = re.search(r"copied, ([\d.]+) s", done.stderr)
        out[kind] = count_4m * 4 * MiB / float(m.group(1)) if m else float("nan")
    return out


def make_file(path: str, nbytes: int) -> None:
    """A fully written file of ``nbytes`` (so no pass pays for allocating extents)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    os.close(fd)
    raw_bandwidth(path, nbytes, 4 * MiB, 4, write=True)


def peak_table(path: str, file_bytes: int, blocks, threads) -> dict:
    """Print write, read and simultaneous read+write bandwidth per block size and thread count over
    the file ``path``; returns the best of each and the (block, threads) of the best simultaneous."""
    best = {"write": 0.0, "read": 0.0, "mixed": 0.0, "mixed_at": (4 * MiB, 4)}
    print(f"(a) peak, sequential O_DIRECT over a {file_bytes // MiB} MiB file, one pass each "
          "(MB/s = 1e6 bytes/s; 'both': T threads write one half while T read the other)")
    print(f"{'block':>8} {'threads':>8} {'write MB/s':>11} {'read MB/s':>10} {'both MB/s':>10}")
    for b in blocks:
        for t in threads:
            w = raw_bandwidth(path, file_bytes, b * MiB, t, write=True)
            r = raw_bandwidth(path, file_bytes, b * MiB, t, write=False)
            x = mixed_bandwidth(path, file_bytes, b * MiB, t)
            best["write"], best["read"] = max(best["write"], w), max(best["read"], r)
            if x > best["mixed"]:
                best["mixed"], best["mixed_at"] = x, (b * MiB, t)
            print(f"{b:>6}Mi {t:>8} {w / 1e6:>11.0f} {r / 1e6:>10.0f} {x / 1e6:>10.0f}")
    print(f"peak: write {best['write'] / 1e6:.0f} MB/s, read {best['read'] / 1e6:.0f} MB/s, "
          f"both at once {best['mixed'] / 1e6:.0f} MB/s")
    return best


def mixed_bandwidth(path: str, file_bytes: int, block: int, threads: int, flip: bool = False) -> float:
    """Bytes per second with ``threads`` threads writing the first half of ``path`` while as many
    read the second half (the other way round when ``flip``): a streamed step reads and writes at
    once, and reads what was written a pass before."""
    half = file_bytes // 2 // block * block
    fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
    views = [byte_view(aligned_empty(block)) for _ in range(2 * threads)]

    def stripe(i):
        write, j = i < threads, i % threads
        base = 0 if write != flip else half
        for off in range(j * block, half, threads * block):
            done = os.pwrite(fd, views[i], base + off) if write else os.preadv(fd, [views[i]], base + off)
            assert done == block, (done, block)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(2 * threads) as pool:
            list(pool.map(stripe, range(2 * threads)))
        return 2 * half / (time.perf_counter() - start)
    finally:
        os.close(fd)


def _update(t, names, step):
    """A small Adam-like update in place (weights, first and second moments)."""
    w, m, v = (t[n] for n in names)
    m.mul_(0.9).add_(w, alpha=0.1)
    v.mul_(0.999).addcmul_(w, w, value=0.001)
    w.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3 / step)


MODES = ("disk", "I/O only", "streamed", "synchronous")


def store_step(directory: str, raw: str, raw_bytes: int, a, peak: dict) -> None:
    """Print (b): in interleaved rounds (so a shared disk's load hits every mode alike), the raw
    simultaneous read+write pass at its best settings ("disk"), the store's streamed step without
    the update ("I/O only": its own bandwidth) and with it ("streamed": the overlap), and the plain
    read-update-write loop ("synchronous")."""
    per = a.subgroup_mib * MiB // 12  # elements per tensor: 3 fp32 tensors per sub-group
    groups = [tuple(f"g{k}.{x}" for x in "wmv") for k in range(max(1, a.state_mib // a.subgroup_mib))]
    specs = {name: per for g in groups for name in g}
    with NvmeStore(directory, specs, block_size=a.block_mib * MiB, io_threads=a.io_threads) as store:
        streamer = Streamer(store, groups, buffer_count=a.buffer_count)
        init = torch.rand(per)
        for name in specs:
            store.write(name, init)
        counts, moved, cpu_s = {m: IOCounts() for m in MODES}, {}, {}
        reps = max(1, round(2 * store.file_bytes / raw_bytes))
        step = [1]

        def timed(mode):
            def run():
                before, cpu = store.stats.snapshot(), time.process_time()
                if mode == "disk":  # as many bytes as a step of the store
                    block = peak["mixed_at"][0]
                    for r in range(reps):
                        mixed_bandwidth(raw, raw_bytes, *peak["mixed_at"], flip=r % 2 == 1)
                    moved["disk"] = reps * (raw_bytes // 2 // block * block * 2)
                else:
                    step[0] += 1
                    _one_step(mode, store, streamer, groups, step[0])
                counts[mode] = counts[mode] + (store.stats.snapshot() - before)
                cpu_s[mode] = cpu_s.get(mode, 0.0) + time.process_time() - cpu
            return run
        for mode in MODES:  # warm-up
            timed(mode)()
        counts, cpu_s = {m: IOCounts() for m in MODES}, {}
        times = interleaved_rounds({m: timed(m) for m in MODES}, a.rounds)
        compute = _compute_only(streamer, groups)
        print(f"\n(b) NvmeStore, {store.io_threads} I/O threads, {store.block_size // MiB} MiB blocks, "
              f"{'O_DIRECT' if store.direct else 'buffered: ' + store.io_note}; {len(groups)} sub-groups "
              f"of {a.subgroup_mib} MiB (fp32 w, m, v), {a.buffer_count} buffers "
              f"({streamer.host_bytes / MiB:.0f} MiB of host memory); {a.rounds} interleaved rounds")
        print(f"the update alone, in memory: {compute * 1e3:.0f} ms per step")
        _report(times, counts, moved, cpu_s, a.rounds)
        if a.checksum_rounds:
            checksum_cost(store, streamer, init, a.checksum_rounds)


def checksum_cost(store, streamer, init, rounds: int) -> None:
    """Print (c): the "I/O only" step with the store's block checksum (XXH3), with zlib's CRC32 in
    its place and with none, in interleaved rounds (each preceded by an untimed rewrite of the state,
    so the checksums on file are the function's own); the ratio of each step to the unchecksummed
    one of the same round."""
    from megazero.offload import nvme
    kinds = {"xxh3 (the store's)": nvme.block_checksum, "zlib crc32": zlib.crc32, "none": lambda mv: 0}
    times = {k: [] for k in kinds}
    try:
        for r in range(rounds + 1):  # round 0: a warm-up
            for k in list(kinds)[r % 3:] + list(kinds)[:r % 3]:
                nvme.block_checksum = kinds[k]
                for name in store.regions:
                    store.write(name, init)
                start = time.perf_counter()
                for _ in streamer.run():
                    pass
                if r:
                    times[k].append(time.perf_counter() - start)
    finally:
        nvme.block_checksum = kinds["xxh3 (the store's)"]
    print(f"\n(c) the blocks' checksums: the I/O-only step, {rounds} interleaved rounds")
    for k, ts in times.items():
        ratio = statistics.median(t / n for t, n in zip(ts, times["none"]))
        print(f"{k:>20} {statistics.median(ts) * 1e3:>8.0f} ms/step {ratio:>6.2f}x the step without")


def _one_step(mode, store, streamer, groups, step):
    if mode != "synchronous":
        for k, t in streamer.run():
            if mode == "streamed":
                _update(t, groups[k], step)
        return
    buf = streamer.buffers[0]
    for k, g in enumerate(groups):
        t = streamer.views(k, buf)
        for n in g:
            store.read(n, t[n])
        _update(t, g, step)
        for n in g:
            store.write(n, t[n])


def _compute_only(streamer, groups) -> float:
    t = streamer.views(0, streamer.buffers[0])
    start = time.perf_counter()
    for _ in groups:
        _update(t, groups[0], 2)
    return time.perf_counter() - start


def _report(times, counts, moved, cpu_s, rounds):
    """Median step time, bandwidth, its ratio to the raw pass of the same round, I/O wait, and the
    CPU seconds (all threads) per GB moved."""
    disk = [moved["disk"] / t for t in times["disk"]]
    print(f"{'mode':>12} {'ms/step':>8} {'read MB':>8} {'written MB':>10} {'MB/s':>6} {'of disk':>8} "
          f"{'I/O wait':>9} {'CPU s/GB':>9}")
    for m, ts in times.items():
        c = counts[m]
        nbytes = moved["disk"] if m == "disk" else (c.bytes_read + c.bytes_written) // rounds
        ratio = statistics.median(nbytes / t / d for t, d in zip(ts, disk))
        wait = f"{'':>9}" if m == "disk" else f"{c.wait_seconds / sum(ts):>9.0%}"
        cpu = cpu_s[m] / (nbytes * rounds / 1e9)
        r, w = (nbytes / 2, nbytes / 2) if m == "disk" else (c.bytes_read / rounds, c.bytes_written / rounds)
        med = statistics.median(ts)
        print(f"{m:>12} {med * 1e3:>8.0f} {r / 1e6:>8.0f} {w / 1e6:>10.0f} {nbytes / med / 1e6:>6.0f} "
              f"{ratio:>8.0%} {wait} {cpu:>9.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    p.add_argument("--raw-mib", type=int, default=512, help="bytes of every pass of the peak measurement")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 8], help="block sizes, MiB")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--dd", action="store_true", help="also time dd bs=4M with oflag/iflag=direct")
    p.add_argument("--state-mib", type=int, default=1024, help="fp32 optimizer state streamed per step")
    p.add_argument("--subgroup-mib", type=int, default=64)
    p.add_argument("--block-mib", type=int, default=1, help="the store's --nvme-block-size, MiB")
    p.add_argument("--io-threads", type=int, default=4, help="the store's --nvme-io-threads")
    p.add_argument("--buffer-count", type=int, default=3, help="the streamer's --nvme-buffer-count")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of (b), after a warm-up")
    p.add_argument("--checksum-rounds", type=int, default=3, help="interleaved rounds of (c); 0: skip it")
    a = p.parse_args(argv)
    set_rank_threads()
    raw = os.path.join(a.dir, "bench_nvme_raw.bin")
    raw_bytes = max(a.raw_mib, a.state_mib) * MiB  # (b) compares with a file as large as the state
    try:
        make_file(raw, raw_bytes)
        peak = peak_table(raw, a.raw_mib * MiB, a.blocks, a.threads)
        if a.dd:
            dd = dd_bandwidth(os.path.join(a.dir, "bench_nvme_dd.bin"), a.raw_mib // 4)
            print(f"dd bs=4M count={a.raw_mib // 4} oflag=direct (a new file): {dd['write'] / 1e6:.0f} MB/s; "
                  f"iflag=direct: {dd['read'] / 1e6:.0f} MB/s")
        store_step(a.dir, raw, raw_bytes, a, peak)
    finally:
        for f in (raw, os.path.join(a.dir, "bench_nvme_dd.bin")):
            if os.path.exists(f):
                os.unlink(f)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
