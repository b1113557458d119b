"""A swap file of named tensors on a local disk, read and written asynchronously with direct I/O.

:class:`NvmeStore` keeps tensors of fixed sizes (any dtype) in one file per rank,
``<--nvme-path>/rank{r}.swap``: every tensor owns a region that starts on a block boundary, the
whole file is allocated when the store opens (so a disk without room fails then, not mid-run),
and a file left by a crashed run is truncated and reused.  The file is scratch: :meth:`close`
(or leaving the ``with`` block, or the interpreter exiting) removes it.  One run per file: the
store locks it before opening it (:mod:`megazero.offload.lock`), and another run's store given the
same file is refused, naming the holder, instead of truncating it.

Every block is checksummed: a 64-bit checksum of each request's bytes (xxHash's XXH3, about ten
times as fast as zlib's CRC32, so that it costs little beside the disk) is computed on the host
buffer on the I/O thread just before the write and kept in memory; a read verifies the bytes it brought in
against it, and a block that differs, or lies past the end of a file cut short, stops the run with
:class:`~megazero.offload.checks.SwapCorruptError`, one line naming the file, the tensor and the
block (a block never written is not checked).

I/O is plain ``os.pwrite``/``os.preadv`` (which release the GIL) on a file opened with ``O_DIRECT``,
split into ``block_size`` requests that ``io_threads`` threads keep in flight.  Direct I/O needs
aligned memory: a tensor whose first byte is 4096-aligned (see :func:`aligned.aligned_empty`,
and the buffers of :class:`~megazero.offload.streamer.Streamer`) is transferred in place, its last
partial page through a 4 KiB bounce; any other tensor, and every CUDA tensor, goes through a
temporary aligned (pinned, on CUDA) copy.  Where the file system refuses ``O_DIRECT`` the store
falls back to buffered I/O and says so in :attr:`NvmeStore.io_note` and a warning.
"""
from __future__ import annotations

import errno
import os
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
from xxhash import xxh3_64_intdigest as block_checksum

from megazero.offload.aligned import ALIGN, aligned_empty, byte_view, is_aligned, round_up, typed_view
from megazero.offload.checks import SwapCorruptError, check_nvme_path, io_error
from megazero.offload.handles import IOHandle, IOStats
from megazero.offload.lock import SwapBusyError, first_refusal, lock_swap_file
from megazero.offload.transfer import direct_works, remove_store, transfer, transfer_tail, unlink_quietly

DEFAULT_BLOCK_SIZE = 1 << 20  #: bytes per I/O request (``--nvme-block-size``)
DEFAULT_IO_THREADS = 4  #: requests in flight, one per thread (``--nvme-io-threads``)
WRITE_FAILED = -1  #: the checksum of a block whose last write failed (a checksum is never negative)

Spec = Union[int, Tuple[int, torch.dtype]]


@dataclass(frozen=True)
class Region:
    """Where tensor ``name`` lives in the swap file: ``numel`` elements of ``dtype`` at byte ``offset``."""
    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_regions(specs: Mapping[str, Spec], block_size: int) -> Tuple[Dict[str, Region], int]:
    """Regions for ``specs`` (name -> numel, or (numel, dtype); fp32 by default) in the given order,
    each starting on a ``block_size`` boundary; also the file size."""
    regions, offset = {}, 0
    for name, spec in specs.items():
        numel, dtype = (spec, torch.float32) if isinstance(spec, int) else spec
        regions[name] = Region(offset, int(numel), dtype)
        offset += round_up(regions[name].nbytes, block_size)
    return regions, offset


def swap_bytes(specs: Mapping[str, Spec], block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Size of the swap file that holds ``specs`` (for start-up checks and memory estimates)."""
    return plan_regions(specs, block_size)[1]


class NvmeStore:
    """Named tensors in ``path/rank{rank}.swap``; see the module docstring.

    ``specs``: name -> numel (fp32) or (numel, dtype).  ``block_size``: bytes per request, a multiple
    of 4096 (default 1 MiB).  ``io_threads``: requests in flight (default 4).  ``pin``: pin the
    temporary host copies (default: when CUDA is available).  ``direct``: try ``O_DIRECT``.
    ``preallocate``: reserve the whole file at open (``posix_fallocate``); without it the file is
    sparse and a full disk shows up on a later write as :class:`~megazero.offload.checks.NvmeSpaceError`.
    ``check_space``: run :func:`~megazero.offload.checks.check_nvme_path` first.  ``name``: the file's
    stem (``{name}{rank}.swap``), so that several stores of one rank share a directory."""

    def __init__(self, path: str, specs: Mapping[str, Spec], rank: int = 0,
                 block_size: int = DEFAULT_BLOCK_SIZE, io_threads: int = DEFAULT_IO_THREADS,
                 pin: Optional[bool] = None, direct: bool = True, preallocate: bool = True,
                 check_space: bool = True, name: str = "rank"):
        if block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"--nvme-block-size {block_size}: must be a positive multiple of {ALIGN} bytes")
        if io_threads < 1:
            raise ValueError(f"--nvme-io-threads {io_threads}: must be at least 1")
        self.block_size, self.io_threads = block_size, io_threads
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.regions, self.file_bytes = plan_regions(specs, block_size)
        self.file = os.path.join(str(path), f"{name}{rank}.swap")  # name: one file per store of a rank
        self.lock = lock_swap_file(self.file)  # before anything truncates it
        try:
            if check_space:
                leftover = os.path.getsize(self.file) if os.path.isfile(self.file) else 0
                check_nvme_path(path, self.file_bytes, reclaimable=leftover)
            self.stats = IOStats()
            self._pending: Dict[str, IOHandle] = {}
            self._sums: Dict[str, List[Optional[int]]] = {}  # name -> checksum of each block written
            self.fd, self.direct, self.io_note = self._open(direct, preallocate)
        except BaseException:
            self.lock.release()
            raise
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="nvme-io")
        self._finalizer = weakref.finalize(self, remove_store, self.fd, self.file, self._pool, self.lock)

    # -- opening --------------------------------------------------------------------------------
    def _open(self, direct: bool, preallocate: bool):
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        use_direct = direct and hasattr(os, "O_DIRECT")
        note = "" if use_direct else "O_DIRECT not requested or not available: buffered I/O"
        try:
            fd = os.open(self.file, flags | (os.O_DIRECT if use_direct else 0), 0o600)
        except OSError as e:
            if not use_direct or e.errno != errno.EINVAL:
                raise io_error(e, self.file, "creating") from e
            fd, use_direct = os.open(self.file, flags, 0o600), False
            note = f"the file system of {self.file} refuses O_DIRECT: buffered I/O (through the page cache)"
        try:
            self._allocate(fd, preallocate)
            if use_direct and not direct_works(fd, self.file):
                os.close(fd)
                fd, use_direct = os.open(self.file, os.O_RDWR, 0o600), False
                note = f"O_DIRECT requests on {self.file} fail: buffered I/O (through the page cache)"
        except BaseException:
            os.close(fd)
            unlink_quietly(self.file)
            raise
        if note and direct:
            warnings.warn(f"--nvme-path: {note}", RuntimeWarning, stacklevel=3)
        return fd, use_direct, note

    def _allocate(self, fd: int, preallocate: bool) -> None:
        try:
            if preallocate and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, max(self.file_bytes, 1))
                    return
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
            os.ftruncate(fd, self.file_bytes)
        except OSError as e:
            raise io_error(e, self.file, "allocating") from e

    # -- asynchronous I/O -----------------------------------------------------------------------
    def write_async(self, name: str, tensor: torch.Tensor) -> IOHandle:
        """Start writing ``tensor`` (CPU or CUDA, ``numel`` and dtype of ``name``) to its region; the
        tensor must not change until the handle's :meth:`~IOHandle.wait` returns."""
        region = self._check(name, tensor)
        self._settle(name)
        host, before = tensor, None
        if not is_aligned(tensor):
            host = typed_view(aligned_empty(region.nbytes, self.pin), 0, region.numel, region.dtype)
            host.copy_(tensor.reshape(-1), non_blocking=tensor.is_cuda)
            if tensor.is_cuda:
                before = torch.cuda.Event()
                before.record()
        futures = self._submit(name, region, host, write=True, before=before)
        handle = IOHandle(self, futures, keep=(tensor, host))
        self.stats.add(written=region.nbytes)
        return self._track(name, handle)

    def read_async(self, name: str, out: torch.Tensor) -> IOHandle:
        """Start reading tensor ``name`` into ``out`` (CPU or CUDA, same numel and dtype); ``out`` holds
        it once the handle's :meth:`~IOHandle.wait` returns (on CUDA: once the current stream gets
        there, the copy being ``non_blocking`` from pinned memory)."""
        region = self._check(name, out)
        self._settle(name)
        if is_aligned(out):
            handle = IOHandle(self, self._submit(name, region, out, write=False), keep=(out,))
        else:
            host = typed_view(aligned_empty(region.nbytes, self.pin), 0, region.numel, region.dtype)
            shape = out.shape

            def finish():
                out.copy_(host.view(shape), non_blocking=out.is_cuda)
            handle = IOHandle(self, self._submit(name, region, host, write=False), finish=finish,
                              keep=(out, host))
        self.stats.add(read=region.nbytes)
        return self._track(name, handle)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """:meth:`write_async` and wait."""
        self.write_async(name, tensor).wait()

    def read(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """:meth:`read_async` and wait; into a new aligned (pinned when :attr:`pin`) tensor when
        ``out`` is None."""
        if out is None:
            r = self.regions[name]
            out = typed_view(aligned_empty(r.nbytes, self.pin), 0, r.numel, r.dtype)
        self.read_async(name, out).wait()
        return out

    def flush(self) -> None:
        """Wait for every request in flight (raising the first error no caller has seen yet)."""
        for name in list(self._pending):
            self._settle(name)

    def close(self) -> None:
        """Finish the requests in flight, then close and remove the swap file (idempotent)."""
        try:
            self.flush()
        finally:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "NvmeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _check(self, name: str, t: torch.Tensor) -> Region:
        if self.closed:
            raise RuntimeError(f"{self.file}: the store is closed")
        region = self.regions.get(name)
        if region is None:
            raise KeyError(f"{name!r} is not a tensor of {self.file}")
        if t.numel() != region.numel or t.dtype != region.dtype:
            raise ValueError(f"{name!r} holds {region.numel} x {region.dtype}, got {t.numel()} x {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name!r}: the tensor must be contiguous")
        return region

    def _settle(self, name: str) -> None:
        """Requests on one name run in the order they were made: wait for the previous one (raising
        its error unless a caller has seen it already)."""
        handle = self._pending.pop(name, None)
        if handle is not None and not handle.reported:
            handle.wait()

    def _track(self, name: str, handle: IOHandle) -> IOHandle:
        self._pending[name] = handle
        return handle

    def _submit(self, name: str, region: Region, host: torch.Tensor, write: bool, before=None):
        """Requests moving the aligned CPU tensor ``host`` to or from ``name``'s ``region``: ``block_size``
        pieces of the whole pages in place, the last partial page through a bounce page; each piece
        (block) checksummed."""
        mv, nbytes = byte_view(host), region.nbytes
        body = nbytes - nbytes % ALIGN
        pieces = [(a, min(a + self.block_size, body)) for a in range(0, body, self.block_size)]
        if body < nbytes:
            pieces.append((body, nbytes))
        sums = self._sums.setdefault(name, [None] * len(pieces))
        return [self._pool.submit(self.stats.busy, _move, self.fd, self.file, mv[a:e], region.offset + a,
                                  write, before, name, k, sums, a >= body) for k, (a, e) in enumerate(pieces)]


def _move(fd: int, file: str, mv: memoryview, offset: int, write: bool, before, name: str, block: int,
          sums: List[Optional[int]], tail: bool) -> None:
    """One block of tensor ``name`` of swap file ``file``, on an I/O thread: its checksum recorded
    before it is written, checked after it is read (requests on one name never overlap, see
    :meth:`NvmeStore._settle`).  A plain function: a request must not hold the store, or the store
    could be dropped, and its finalizer run, on one of its own I/O threads."""
    move = transfer_tail if tail else transfer
    if write:
        if before is not None:
            before.synchronize()
        sums[block] = block_checksum(mv)
        try:
            move(fd, mv, offset, True, file, None)
        except BaseException:
            sums[block] = WRITE_FAILED
            raise
        return
    try:
        move(fd, mv, offset, False, file, None)
    except OSError:
        size = os.fstat(fd).st_size
        if size < offset + len(mv):
            raise SwapCorruptError(file, name, block, offset, len(mv), f"lies past the end of the file "
                                   f"({size} bytes): it was cut short") from None
        raise
    want = sums[block]
    if want == WRITE_FAILED:
        raise SwapCorruptError(file, name, block, offset, len(mv), "its last write failed (see the error it "
                               "raised), so it holds no whole value")
    if want is not None:
        got = block_checksum(mv)
        if got != want:
            raise SwapCorruptError(file, name, block, offset, len(mv),
                                   f"fails its checksum ({got:016x} read, {want:016x} written)")


def open_store(mesh, *args, **kwargs) -> "NvmeStore":
    """``NvmeStore(*args, **kwargs)`` on every rank of ``mesh`` (a collective): when any rank's swap
    file is held by another run, every rank closes its store and raises the same
    :class:`~megazero.offload.lock.SwapBusyError` (the first refused rank's message; rank 0 reports it)."""
    store, refused = None, None
    try:
        store = NvmeStore(*args, **kwargs)
    except SwapBusyError as err:
        refused = str(err)
    first = first_refusal(refused, mesh)
    if first is None:
        return store
    if store is not None:
        store.close()
    raise SwapBusyError(first, everywhere=True)
