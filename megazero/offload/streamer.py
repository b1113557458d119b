"""Streaming sub-groups through a bounded set of host buffers: read ahead, update, write back.

An optimizer step over a swapped shard walks its sub-groups in order.  :meth:`Streamer.run` yields
sub-group ``k`` in a host buffer while, in the background, sub-group ``k+1`` is being read into
another buffer and sub-group ``k-1`` written back from a third: with ``buffer_count=3`` (triple
buffering) both transfers overlap the caller's work on ``k``; with 2 only the read does, the
write of ``k-1`` finishing before the read of ``k+1`` can take its buffer.  More buffers read
further ahead.  ``run(carry=True)`` also reads the first sub-groups of the next walk ahead and
leaves the last write-back in flight, so they overlap the caller's work between walks.  Host
memory stays at ``buffer_count`` buffers of the largest sub-group whatever the number of
sub-groups.

A sub-group is one name of the store or several (say a bucket's master weights and both Adam
moments), packed into one buffer, each at an aligned offset so every transfer is in place::

    streamer = Streamer(store, [("g0.w", "g0.m", "g0.v"), ("g1.w", "g1.m", "g1.v")])
    for k, t in streamer.run():          # every step
        adam_update(t["g%d.w" % k], ...)  # in place; written back after the loop body
"""
from __future__ import annotations

from collections import deque
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megazero.offload.aligned import ALIGN, aligned_empty, round_up, typed_view

Group = Union[str, Sequence[str]]


class Streamer:
    """Sub-groups ``groups`` of ``store`` streamed through ``buffer_count`` (>= 2, default 3) host
    buffers of ``buffer_bytes`` each (default: the largest sub-group; ``--nvme-buffer-size``),
    aligned and pinned like the store's (``store.pin``).  ``writeback=False`` streams read-only
    (parameters for a forward pass): buffers are reused without writing them back."""

    def __init__(self, store, groups: Sequence[Group], buffer_count: int = 3,
                 buffer_bytes: Optional[int] = None, writeback: bool = True):
        if buffer_count < 2:
            raise ValueError(f"--nvme-buffer-count {buffer_count}: streaming needs at least 2 buffers")
        self.store, self.writeback = store, writeback
        self.groups: List[Tuple[str, ...]] = [(g,) if isinstance(g, str) else tuple(g) for g in groups]
        self.layouts = [self._layout(g) for g in self.groups]
        needed = max((end for _, end in self.layouts), default=ALIGN)
        if buffer_bytes is not None and buffer_bytes < needed:
            raise ValueError(f"--nvme-buffer-size {buffer_bytes}: the largest sub-group needs {needed} bytes")
        size = round_up(buffer_bytes or needed)
        self.buffers = [aligned_empty(size, pin=store.pin) for _ in range(buffer_count)]
        self._fences: List[list] = [[] for _ in self.buffers]  # per buffer: events to wait before refilling
        self._in_hand: Optional[int] = None  # the buffer the caller holds inside run()
        self._carried = None  # run(carry=True): (order read ahead, reads, writes, free buffers)

    @property
    def host_bytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(b.numel() for b in self.buffers)

    def _layout(self, group: Tuple[str, ...]):
        offsets, end = {}, 0
        for name in group:
            region = self.store.regions[name]
            offsets[name] = (end, region)
            end += round_up(region.nbytes)
        return offsets, end

    def views(self, k: int, buf: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Sub-group ``k``'s tensors as flat views of ``buf``."""
        return {name: typed_view(buf, off, r.numel, r.dtype) for name, (off, r) in self.layouts[k][0].items()}

    def run(self, order: Optional[Sequence[int]] = None,
            carry: bool = False) -> Iterator[Tuple[int, Dict[str, torch.Tensor]]]:
        """Yield ``(k, {name: tensor})`` for every sub-group ``k`` in ``order`` (default: all, in order).
        The tensors are the buffer itself: change them in place; when the loop body returns they
        are written back (``writeback``).  Every write and :meth:`fence` has finished when the loop
        ends, unless ``carry``: then the last write-backs stay in flight and the first sub-groups of
        the same ``order`` are read ahead for the next call, so both overlap whatever the caller
        does in between (the forward and backward of the next step); a next call with another
        order, and :meth:`drain`, settle them.  Leaving the loop early (``break``, an exception) does
        not write back the sub-group in hand and settles everything."""
        order = list(range(len(self.groups))) if order is None else list(order)
        free, reads, writes = self._start(order)
        issued, finished = len(reads), False
        try:
            for pos, k in enumerate(order):
                # the next sub-group's read must be under way before the caller works on this one
                # (waiting for the oldest write-back if no buffer is free); further ones only when free
                while issued < len(order) and (issued <= pos + 1 or free):
                    i = self._take(free.popleft() if free else self._reclaim(writes))
                    reads.append((issued, i, self._read(order[issued], self.buffers[i])))
                    issued += 1
                got, i, handles = reads.popleft()
                assert got == pos
                _wait(handles)
                views = self.views(k, self.buffers[i])
                self._in_hand = i
                yield k, views
                self._in_hand = None
                if self.writeback:
                    writes.append((i, [self.store.write_async(n, t) for n, t in views.items()]))
                else:
                    free.append(i)
            finished = True
        finally:
            self._in_hand = None
            if finished and carry:
                self._read_ahead(order, free, writes)
            else:
                self._settle(reads, writes)

    def drain(self) -> None:
        """Settle what :meth:`run` ``carry`` left in flight: wait for the write-backs (raising the
        first error) and drop the reads ahead.  Call it before the store or the buffers are used
        outside :meth:`run` (checkpoints, loading)."""
        carried, self._carried = self._carried, None
        if carried is not None:
            self._settle(carried[1], carried[2])

    def _start(self, order: List[int]):
        """``(free buffers, reads in flight, writes in flight)`` for a run over ``order``: those carried
        from the last run when it read ahead for this order, else settled and empty."""
        carried, self._carried = self._carried, None
        if carried is not None:
            prefix, reads, writes, free = carried
            if order[:len(prefix)] == prefix:
                return free, reads, writes
            self._settle(reads, writes)
        return deque(range(len(self.buffers))), deque(), deque()

    def _read_ahead(self, order: List[int], free: deque, writes: deque) -> None:
        """After a run: read the first sub-groups of ``order`` into all buffers but one (reclaiming
        the oldest write-backs), leaving the newest write-back in flight."""
        reads: deque = deque()
        try:
            for pos in range(min(len(order), len(self.buffers) - 1)):
                i = self._take(free.popleft() if free else self._reclaim(writes))
                reads.append((pos, i, self._read(order[pos], self.buffers[i])))
        except BaseException:
            self._settle(reads, writes)
            raise
        self._carried = ([order[p] for p, _, _ in reads], reads, writes, free)

    def _settle(self, reads, writes) -> None:
        """Wait for every read and write given (all of them), free every buffer, raise the first error."""
        errors = [_wait(h, swallow=True) for _, _, h in reads]
        errors += [_wait(h, swallow=True) for _, h in writes]
        for i in range(len(self.buffers)):
            self._take(i)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def fence(self, event) -> None:
        """Keep the buffer in hand from being refilled until ``event.synchronize()`` returns: call it
        in the loop body with the CUDA event recorded after a ``non_blocking`` copy out of the
        yielded tensors (say the updated masters to the device parameters)."""
        if self._in_hand is None:
            raise RuntimeError("Streamer.fence: only inside the loop body of run()")
        self._fences[self._in_hand].append(event)

    def _take(self, i: int) -> int:
        fences, self._fences[i] = self._fences[i], []
        for event in fences:
            event.synchronize()
        return i

    def _read(self, k: int, buf: torch.Tensor):
        return [self.store.read_async(n, t) for n, t in self.views(k, buf).items()]

    @staticmethod
    def _reclaim(writes: deque) -> int:
        i, handles = writes.popleft()
        _wait(handles)
        return i


def _wait(handles, swallow: bool = False):
    """Wait for every handle (all of them, even after an error); raise the first error, or return it
    when ``swallow``."""
    first = None
    for h in handles:
        try:
            h.wait()
        except BaseException as e:  # keep waiting: the other requests still use the buffer
            first = first or e
    if first is not None and not swallow:
        raise first
    return first
