"""Handles of asynchronous swap-file requests and the I/O counters a trainer logs per iteration."""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import wait as wait_all
from typing import Callable, Optional, Sequence


@dataclasses.dataclass
class IOCounts:
    """Totals of a store's traffic: bytes asked of the disk (each request counted when it is made),
    the seconds callers spent blocked in :meth:`IOHandle.wait` (the I/O the work did not hide) and the
    seconds during which at least one request was being served (``busy_seconds``: bytes over it is
    the bandwidth while streaming)."""
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    wait_seconds: float = 0.0
    busy_seconds: float = 0.0

    def __sub__(self, other: "IOCounts") -> "IOCounts":
        return IOCounts(*(getattr(self, f.name) - getattr(other, f.name)
                          for f in dataclasses.fields(self)))

    def __add__(self, other: "IOCounts") -> "IOCounts":
        return IOCounts(*(getattr(self, f.name) + getattr(other, f.name)
                          for f in dataclasses.fields(self)))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class IOStats:
    """Thread-safe running :class:`IOCounts`; ``snapshot()`` before and after an iteration and
    subtract to log that iteration's I/O bytes and I/O wait."""

    def __init__(self):
        self._counts = IOCounts()
        self._lock = threading.Lock()
        self._active, self._since = 0, 0.0  # requests being served; when the first of them began

    def add(self, read: int = 0, written: int = 0, wait_seconds: float = 0.0) -> None:
        with self._lock:
            c = self._counts
            c.bytes_read += read
            c.bytes_written += written
            c.reads += read > 0
            c.writes += written > 0
            c.wait_seconds += wait_seconds

    def busy(self, fn: Callable, *args):
        """``fn(*args)`` on an I/O thread, counted in ``busy_seconds`` (the union of the requests'
        service times)."""
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._counts.busy_seconds += time.perf_counter() - self._since

    def snapshot(self) -> IOCounts:
        with self._lock:
            return dataclasses.replace(self._counts)

    def reset(self) -> IOCounts:
        """Zero the counters; returns what they held."""
        with self._lock:
            out, self._counts = self._counts, IOCounts()
            return out

    def __getattr__(self, name):  # stats.bytes_read, stats.wait_seconds, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.snapshot(), name)


class IOHandle:
    """One read or write in flight: :meth:`wait` blocks until every request of it is done (the time
    blocked is added to the store's ``wait_seconds``) and re-raises the first error."""

    def __init__(self, store, futures: Sequence, finish: Optional[Callable[[], None]] = None, keep=()):
        self._stats = store.stats
        self._futures = list(futures)
        self._finish = finish
        self._keep = keep  # the tensors whose memory the requests use, alive until they are done
        self._error: Optional[BaseException] = None
        self._waited = False
        self.reported = False  # its error has been raised to a caller

    def done(self) -> bool:
        """Whether :meth:`wait` would return at once (a ``finish`` copy may still be pending)."""
        return self._waited or all(f.done() for f in self._futures)

    def wait(self) -> None:
        if not self._waited:
            start = time.perf_counter()
            try:
                wait_all(self._futures)  # every request ends before its memory may be released
                for f in self._futures:
                    if f.exception() is not None:
                        self._error = f.exception()
                        break
                if self._error is None and self._finish is not None:
                    try:
                        self._finish()
                    except BaseException as e:
                        self._error = e
            finally:
                self._waited, self._futures, self._finish, self._keep = True, [], None, ()
                self._stats.add(wait_seconds=time.perf_counter() - start)
        if self._error is not None:
            self.reported = True
            raise self._error
