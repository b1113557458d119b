"""The NVMe swap store (megazero.offload): exact round trips, streamed sub-groups equal to a plain loop,
counters, start-up errors naming --nvme-path, a disk that fills mid-write, scratch-file lifetime."""
import errno
import gc
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from megazero.offload import NvmeSpaceError, NvmeStore, Streamer, aligned_empty, check_nvme_path, swap_bytes
from megazero.offload.checks import SwapCorruptError
from megazero.offload.lock import SwapBusyError
from megazero.offload import nvme
from megazero.offload.aligned import typed_view

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16384  # small blocks: every tensor of a few KiB spans several requests

SIZES = [1, 3, 1023, 1024, 1025, 4097, 12345, 70001]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _bits(numel, dtype, seed):
    """A tensor of random bits (NaNs and all), compared bitwise through its bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _same(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _specs():
    return {f"t{i}_{str(d)[6:]}": (n, d) for i, (n, d) in enumerate((n, d) for n in SIZES for d in DTYPES)}


def test_round_trip_is_bitwise_for_any_size_dtype_and_alignment(tmp_path):
    specs = _specs()
    with NvmeStore(tmp_path, specs, block_size=BLOCK, io_threads=3) as store:
        data = {name: _bits(n, d, i) for i, (name, (n, d)) in enumerate(specs.items())}
        handles = []
        for i, (name, t) in enumerate(data.items()):
            if i % 2:  # unaligned source: a view one element into a larger tensor
                src = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].copy_(t)
            else:  # aligned source: transferred in place
                src = typed_view(aligned_empty(t.numel() * t.dtype.itemsize), 0, t.numel(), t.dtype).copy_(t)
            handles.append(store.write_async(name, src))
        for h in handles:
            h.wait()
        for i, (name, t) in enumerate(data.items()):
            out = torch.empty(t.numel() + 1, dtype=t.dtype)[1:] if i % 3 == 0 else None
            assert _same(store.read(name, out), t), name
            assert _same(store.read(name), t), name
        assert os.path.getsize(store.file) == store.file_bytes == swap_bytes(specs, BLOCK)
        assert all(r.offset % BLOCK == 0 for r in store.regions.values())


@pytest.mark.parametrize("refused", ["open", "requests"])
def test_buffered_fallback_when_direct_io_is_refused(tmp_path, monkeypatch, refused):
    if refused == "requests":  # the flag accepted at open, the requests refused
        monkeypatch.setattr(nvme, "direct_works", lambda fd, file: False)
        match = "--nvme-path: O_DIRECT requests on .* fail: buffered I/O"
    else:  # like tmpfs before Linux 6.6
        real_open = os.open

        def no_direct(path, flags, *mode):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *mode)
        monkeypatch.setattr(nvme.os, "open", no_direct)
        match = "--nvme-path: the file system of .* refuses O_DIRECT: buffered I/O"
    with pytest.warns(RuntimeWarning, match=match):
        store = NvmeStore(tmp_path, {"a": 5000, "b": (77, torch.bfloat16)}, block_size=BLOCK)
    with store:
        assert not store.direct and "buffered" in store.io_note
        a, b = _bits(5000, torch.float32, 1), _bits(77, torch.bfloat16, 2)
        store.write("a", a)
        store.write("b", b)
        assert _same(store.read("a"), a) and _same(store.read("b"), b)


def _adam_like(w, m, v, step):
    m.mul_(0.9).add_(w, alpha=0.1)
    v.mul_(0.999).addcmul_(w, w, value=0.001)
    w.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-2 / step)


@pytest.mark.parametrize("buffers", [2, 3, 5])
def test_streamed_step_equals_the_synchronous_loop(tmp_path, buffers):
    sizes = [3000, 1, 4097, 20000, 777, 12288, 5]
    names = [tuple(f"g{k}.{x}" for x in "wmv") for k in range(len(sizes))]
    specs = {n: size for g, size in zip(names, sizes) for n in g}
    ref = {n: torch.randn(size, generator=torch.Generator().manual_seed(i)).abs()
           for i, (g, size) in enumerate(zip(names, sizes)) for n in g}
    with NvmeStore(tmp_path, specs, block_size=BLOCK, io_threads=4) as store:
        for n, t in ref.items():
            store.write(n, t)
        streamer = Streamer(store, names, buffer_count=buffers)
        assert streamer.host_bytes == buffers * 3 * 81920  # the largest sub-group, pages per tensor
        for step in (1, 2, 3):
            seen = []
            for k, t in streamer.run():
                seen.append(k)
                _adam_like(*(t[n] for n in names[k]), step)
            for g in names:  # the same update, in memory, one sub-group after the other
                _adam_like(*(ref[n] for n in g), step)
            assert seen == list(range(len(sizes)))
        for n, t in ref.items():
            assert _same(store.read(n), t), n
        order = [6, 0, 3]  # read-only streaming in any order (parameters: reverse for backward)
        before = store.stats.snapshot()
        reader = Streamer(store, names, buffer_count=buffers, writeback=False)
        got = {k: {n: x.clone() for n, x in t.items()} for k, t in reader.run(order)}
        assert list(got) == order and all(_same(got[k][n], ref[n]) for k in order for n in names[k])
        assert (store.stats.snapshot() - before).bytes_written == 0


def test_carry_reads_the_next_walk_ahead_and_settles_on_another_order(tmp_path):
    sizes = [3000, 4097, 20000, 777]
    names = [tuple(f"g{k}.{x}" for x in "wmv") for k in range(len(sizes))]
    specs = {n: size for g, size in zip(names, sizes) for n in g}
    ref = {n: torch.randn(size, generator=torch.Generator().manual_seed(i)).abs()
           for i, (g, size) in enumerate(zip(names, sizes)) for n in g}
    group_bytes = [3 * 4 * size for size in sizes]
    with NvmeStore(tmp_path, specs, block_size=BLOCK, io_threads=2) as store:
        for n, t in ref.items():
            store.write(n, t)
        streamer = Streamer(store, names, buffer_count=3)
        # walk 3 takes another order: the sub-groups read ahead for it are dropped and read again
        orders = [None, None, [3, 1, 0, 2], None]
        total = sum(group_bytes)
        for step, order in enumerate(orders, start=1):
            before = store.stats.snapshot()
            seen = []
            for k, t in streamer.run(order, carry=True):
                seen.append(k)
                _adam_like(*(t[n] for n in names[k]), step)
            for k in seen:
                _adam_like(*(ref[n] for n in names[k]), step)
            assert seen == (order or list(range(len(sizes))))
            ahead = sum(group_bytes[k] for k in seen[:2])  # the next walk's first two, asked for now
            reused = ahead if step == 2 else 0  # walk 2 found its first two read by walk 1
            assert (store.stats.snapshot() - before).bytes_read == total - reused + ahead
        streamer.drain()
        for n, t in ref.items():
            assert _same(store.read(n), t), n


def test_leaving_the_loop_early_writes_back_what_was_done(tmp_path):
    specs = {f"s{k}": 3000 for k in range(6)}
    with NvmeStore(tmp_path, specs, block_size=BLOCK) as store:
        for n in specs:
            store.write(n, torch.zeros(3000))
        for k, t in Streamer(store, list(specs)).run():
            if k == 3:
                break
            t[f"s{k}"].add_(k + 1)
        for k in range(6):
            assert torch.equal(store.read(f"s{k}"), torch.full((3000,), float(k + 1 if k < 3 else 0)))


class _Event:
    """Stands for a CUDA event: records when it was synchronized."""

    def __init__(self, log, k):
        self.log, self.k = log, k

    def synchronize(self):
        self.log.append(("fence", self.k))


def test_fenced_buffers_wait_for_their_event_before_a_refill(tmp_path, monkeypatch):
    specs = {f"s{k}": 3000 for k in range(5)}
    log = []
    with NvmeStore(tmp_path, specs, block_size=BLOCK) as store:
        streamer = Streamer(store, list(specs), buffer_count=2)
        real_read = store.read_async
        monkeypatch.setattr(store, "read_async", lambda n, out: log.append(("read", n)) or real_read(n, out))
        with pytest.raises(RuntimeError, match="only inside the loop body"):
            streamer.fence(_Event(log, -1))
        for k, _t in streamer.run():
            streamer.fence(_Event(log, k))
        # two buffers: sub-group k's buffer is refilled with k + 2 only after k's event
        for k in range(3):
            assert log.index(("fence", k)) < log.index(("read", f"s{k + 2}"))
        assert sorted(e for e in log if e[0] == "fence") == [("fence", k) for k in range(5)]


def test_counters_add_up(tmp_path):
    specs = {"a": 1000, "b": (4097, torch.bfloat16), "c": 70000}
    nbytes = {"a": 4000, "b": 8194, "c": 280000}
    with NvmeStore(tmp_path, specs, block_size=BLOCK) as store:
        assert store.stats.bytes_read == store.stats.bytes_written == 0
        for n, r in store.regions.items():
            store.write(n, torch.ones(r.numel, dtype=r.dtype))
        mid = store.stats.snapshot()
        assert (mid.bytes_written, mid.writes, mid.bytes_read, mid.reads) == (sum(nbytes.values()), 3, 0, 0)
        for _ in range(2):
            for n in specs:
                store.read(n)
        c = store.stats.snapshot() - mid
        assert (c.bytes_read, c.reads, c.bytes_written, c.writes) == (2 * sum(nbytes.values()), 6, 0, 0)
        assert 0 < c.wait_seconds and c.wait_seconds == store.stats.wait_seconds - mid.wait_seconds
        streamer = Streamer(store, [("a", "b"), ("c",)])
        before = store.stats.snapshot()
        for _k, _t in streamer.run():
            pass
        c = store.stats.snapshot() - before
        assert c.bytes_read == c.bytes_written == sum(nbytes.values()) and c.reads == c.writes == 3
        assert store.stats.reset().bytes_read > 0 and store.stats.bytes_read == 0


def test_requests_on_one_name_run_in_order(tmp_path):
    with NvmeStore(tmp_path, {"x": 100000}, block_size=BLOCK) as store:
        out = torch.empty(100000)
        for value in range(4):  # no wait in between: each request waits for the previous one
            store.write_async("x", torch.full((100000,), float(value)))
            store.read_async("x", out)
        store.flush()
        assert torch.equal(out, torch.full((100000,), 3.0))


def test_bad_paths_and_too_little_space_are_named(tmp_path):
    with pytest.raises(ValueError, match="--nvme-path is required"):
        check_nvme_path(None, 1)
    with pytest.raises(ValueError, match="--nvme-path .*nope: no such directory"):
        check_nvme_path(str(tmp_path / "nope"), 1)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="--nvme-path .*f: not a directory"):
        check_nvme_path(str(tmp_path / "f"), 1)
    free = shutil.disk_usage(tmp_path).free
    need = free + 5 * 2 ** 30
    msg = (rf"--nvme-path {tmp_path}: needs {need / 2 ** 30:.1f} GiB for this rank's swap files, "
           rf"{free / 2 ** 30:.1f} GiB free; choose a larger disk or raise ZeRO/DP")
    with pytest.raises(ValueError, match=msg):
        check_nvme_path(str(tmp_path), need)
    assert check_nvme_path(str(tmp_path), 4096) == str(tmp_path)
    with pytest.raises(ValueError, match="--nvme-path .*: needs .* GiB for this rank's swap files"):
        NvmeStore(tmp_path, {"huge": free // 4 + 2 ** 30})
    assert os.listdir(tmp_path) == ["f"]  # refused before creating anything
    with pytest.raises(ValueError, match="--nvme-block-size 1000"):
        NvmeStore(tmp_path, {"x": 1}, block_size=1000)
    with pytest.raises(ValueError, match="--nvme-buffer-count 1"):
        with NvmeStore(tmp_path, {"x": 1}) as store:
            Streamer(store, ["x"], buffer_count=1)


def _mount_tmpfs(path, size, options=""):
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    opts = f"size={size}" + (f",{options}" if options else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True)
    return done.returncode == 0


def test_unwritable_path_is_named(tmp_path):
    d = str(tmp_path / "ro")
    if os.geteuid() != 0:
        os.makedirs(d)
        os.chmod(d, 0o500)
    elif not _mount_tmpfs(d, "1m", "ro"):
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(ValueError, match="--nvme-path .*ro: not writable by this process"):
            check_nvme_path(d, 1)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", d], capture_output=True)


def test_a_disk_that_fills_mid_write_is_named(tmp_path):
    d = str(tmp_path / "small")
    if not _mount_tmpfs(d, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        specs = {f"x{k}": 2 ** 17 for k in range(3)}  # 3 x 512 KiB on a 1 MiB disk
        full = rf"--nvme-path {d}: no space left on device while allocating"
        with pytest.raises(NvmeSpaceError, match=full):
            NvmeStore(d, specs, check_space=False)  # preallocation finds out at once
        assert os.listdir(d) == []
        with NvmeStore(d, specs, check_space=False, preallocate=False, block_size=BLOCK) as store:
            store.write("x0", torch.ones(2 ** 17))
            with pytest.raises(NvmeSpaceError) as err:
                for k in (1, 2):
                    store.write(f"x{k}", torch.ones(2 ** 17))
            assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
            assert f"--nvme-path {d}: no space left on device while writing {store.file}" in str(err.value)
            assert torch.equal(store.read("x0"), torch.ones(2 ** 17))
            with pytest.raises(SwapCorruptError, match=r"block \d+ of 'x1' .*its last write failed"):
                store.read("x1")  # part of it never reached the disk
            with pytest.raises(NvmeSpaceError, match="while writing"):  # a streamed write-back, too
                for _k, t in Streamer(store, ["x0", "x2"], buffer_count=2).run():
                    t[next(iter(t))].add_(1)
        assert os.listdir(d) == []
    finally:
        subprocess.run(["umount", "-l", d], capture_output=True)


def test_swap_file_is_scratch(tmp_path):
    leftover = tmp_path / "rank3.swap"
    leftover.write_bytes(b"\xff" * 300000)  # a crashed run's file: overwritten
    store = NvmeStore(tmp_path, {"a": 1000}, rank=3, block_size=BLOCK)
    assert store.file == str(leftover) and os.path.getsize(leftover) == BLOCK
    assert torch.equal(store.read("a"), torch.zeros(1000))
    store.close()
    store.close()  # idempotent
    assert not leftover.exists() and store.closed
    with pytest.raises(RuntimeError, match="closed"):
        store.write("a", torch.zeros(1000))
    with NvmeStore(tmp_path, {"a": 1000}) as store:
        assert sorted(os.listdir(tmp_path)) == [".rank0.swap.lock", "rank0.swap"]  # its lock beside it
        with pytest.raises(KeyError):
            store.write("b", torch.zeros(1))
        with pytest.raises(ValueError, match="holds 1000 x torch.float32"):
            store.write("a", torch.zeros(1000, dtype=torch.float16))
    assert os.listdir(tmp_path) == []
    store = NvmeStore(tmp_path, {"a": 1000})
    del store
    gc.collect()  # dropped without close(): the file goes too
    assert os.listdir(tmp_path) == []


def test_a_flipped_byte_and_a_cut_file_are_named_by_file_and_block(tmp_path):
    """Every block is checksummed when written and checked when read: a byte flipped on disk names the
    tensor and the block it is in (whatever the alignment: in place, through a copy, the last partial
    page); a file cut short names the first block past its end.  Blocks never written are not checked."""
    x = torch.arange(70001, dtype=torch.float32)  # 4 whole 16 KiB blocks, then a partial page
    with NvmeStore(tmp_path, {"x": 70001, "y": 100}, block_size=BLOCK) as store:
        assert torch.equal(store.read("y"), torch.zeros(100))  # never written: not checked
        store.write("x", x)
        assert torch.equal(store.read("x"), x)
        for offset, block in ((5, 0), (BLOCK + 7, 1), (4 * BLOCK + 100, 4)):  # the last: the partial page
            with open(store.file, "r+b") as fh:
                fh.seek(offset)
                byte = fh.read(1)
                fh.seek(offset)
                fh.write(bytes([byte[0] ^ 0x10]))
            named = (rf"--nvme-path {tmp_path}: swap file {store.file}, block {block} of 'x' "
                     r"\(bytes \d+-\d+\): fails its checksum \(\w{16} read, \w{16} written\)")
            for out in (None, torch.empty(70002)[1:]):  # an aligned buffer, and a copy through one
                with pytest.raises(SwapCorruptError, match=named):
                    store.read("x", out)
            store.write("x", x)  # rewritten: whole again
        assert torch.equal(store.read("x"), x)
        os.truncate(store.file, 2 * BLOCK + 10)
        with pytest.raises(SwapCorruptError, match=r"block 2 of 'x' \(bytes 32768-49151\): lies past the end "
                                                   r"of the file \(32778 bytes\): it was cut short"):
            store.read("x")


def test_a_second_store_on_the_same_swap_file_is_refused_and_the_first_is_not_truncated(tmp_path):
    """The swap file's lock is taken before the file is opened: a second run's store names the holder
    and leaves the file alone; a store of another name (another tier) shares the directory."""
    holder = subprocess.Popen(  # a store's lock and file (without importing torch: quick)
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
         "from megazero.process.run_lock import RunLock; RunLock.acquire(sys.argv[2] + '/.rank0.swap.lock'); "
         "open(sys.argv[2] + '/rank0.swap', 'wb').write(b'state' * 4096); print('held', flush=True); "
         "time.sleep(120)", ROOT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = open(tmp_path / "rank0.swap", "rb").read()
        holder_named = (rf"--nvme-path {tmp_path}: another run is using the swap file {tmp_path}/rank0.swap "
                        rf"\(run \w+, pid {holder.pid} on {socket.gethostname()}, since .*\). Two runs must "
                        "not share")
        with pytest.raises(SwapBusyError, match=holder_named):
            NvmeStore(tmp_path, {"b": 10}, block_size=BLOCK)
        assert open(tmp_path / "rank0.swap", "rb").read() == before
        with NvmeStore(tmp_path, {"b": 10}, block_size=BLOCK, name="params-rank"):
            pass  # another file: allowed
    finally:
        holder.kill()
        holder.wait()
    with NvmeStore(tmp_path, {"b": 10}, block_size=BLOCK):  # the holder died: the lock is free at once
        pass
    assert os.listdir(tmp_path) == []  # the dead holder's scratch file was reused, then removed


def test_a_store_dropped_with_requests_in_flight_frees_its_file_and_lock_at_once(tmp_path, monkeypatch):
    """The requests on the I/O threads hold no reference to the store: dropping it finishes them,
    removes the file and releases its lock in the dropping thread (a request that held the store
    kept it, and its lock, alive, and ran its finalizer on an I/O thread: "cannot join current
    thread")."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    for _ in range(8):
        store = NvmeStore(tmp_path, {"a": 100000}, block_size=BLOCK)
        handle = store.write_async("a", torch.ones(100000))
        del store
        assert os.listdir(tmp_path) == []  # gone at once, lock and all: the next store may take the file
        handle.wait()
    gc.collect()
    assert unraisable == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_go_through_pinned_buffers(tmp_path):
    with NvmeStore(tmp_path, {"a": 70001, "b": (12345, torch.bfloat16)}, block_size=BLOCK) as store:
        assert store.pin
        a, b = _bits(70001, torch.float32, 3).cuda(), _bits(12345, torch.bfloat16, 4).cuda()
        store.write_async("a", a)
        store.write_async("b", b).wait()
        out = torch.empty_like(a)
        store.read_async("a", out).wait()
        torch.cuda.current_stream().synchronize()
        assert _same(out.cpu(), a.cpu()) and _same(store.read("b"), b.cpu())
        streamer = Streamer(store, [("a", "b")])
        assert all(buf.is_pinned() for buf in streamer.buffers)


@pytest.mark.slow
def test_the_benchmark_runs_and_cleans_up(tmp_path):  # a subprocess: ~5 s on 2 busy cores
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--dir", str(tmp_path), "--raw-mib", "8", "--blocks", "1", "--threads", "1", "2",
            "--state-mib", "8", "--subgroup-mib", "4", "--rounds", "1", "--checksum-rounds", "1"]
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_nvme_io.py")] + args,
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "peak: write" in proc.stdout and "I/O only" in proc.stdout and "synchronous" in proc.stdout
    assert re.search(r"zlib crc32 +\d+ ms/step +[\d.]+x the step without", proc.stdout), proc.stdout
    assert os.listdir(tmp_path) == []
