"""Gradient synchronisation over the data-parallel axis: what happens to a bucket during backward.

Gradients reach the flat buffers through ``post_accumulate_grad`` hooks (``param.grad`` is
added into the bucket and dropped).  When all of a bucket's parameters have their gradient, the
bucket is *complete* and its reduction can start while backward goes on:

- :class:`LastMicroBatchReducer` (stages 0/1): gradients accumulate in the full buffer over the
  micro-batches; each bucket is reduced once, in the last micro-batch's backward (an all-reduce
  at stage 0, a reduce-scatter into the owned slice at stage 1);
- :class:`EveryMicroBatchReducer` (stages 2/3): each backward collects a bucket's gradients in a
  full-bucket *partial* buffer that is reduce-scattered and added into the gradient shard.

Gradient memory in flight is bounded (:class:`InFlight`): before a reduction that holds
temporaries is launched, every earlier one is waited for and retired (its slice added into the
shard, its temporaries freed), and a finished one is retired as soon as the next bucket starts;
so one reduction runs while the next bucket fills, and the gradient bytes never exceed the
persistent buffer plus three buckets (two on backends with a native reduce-scatter).
``finish_grad_sync`` waits for everything and does the once-per-step sums over TP
(sequence-parallel parameters) and the embedding group (tied embeddings); summing the
DP-reduced slice over those groups equals reducing the summed gradient, as bucket layouts match
across them.  With ``--no-overlap-grad-reduce`` stages 0/1 reduce after the last backward;
stages 2/3 reduce each bucket when it completes and wait for it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from megazero.zero.buffers import Bucket
from megazero.zero.comm import Reduction, all_reduce_mean, reduce_scatter
from megazero.zero.stages import shards_optimizer
from megazero.zero.storage import FlatStorage


class GradSync(Protocol):
    """What the pipeline executor and the trainer call on the optimizer around backward."""

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        """Before each backward of model chunk ``chunk_index``."""

    def finish_grad_sync(self) -> None:
        """After the schedule: every reduction done, gradients ready for the step."""

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without fp16)."""


@dataclass
class BucketProgress:
    """A bucket's state during the current step."""
    arrived: int = 0                        # gradients received in the current backward
    reduced: bool = False                   # stages 0/1: reduction launched in this step
    partial: Optional[torch.Tensor] = None  # stages 2/3: this backward's gradients, full bucket
    written: List[bool] = field(default_factory=list)  # which parameters reached ``partial``


class GradBytes:
    """Gradient bytes held now (temporaries included) and their high-water mark."""

    def __init__(self, persistent: int):
        self.live = self.peak = persistent

    def hold(self, nbytes: int, transient: int = 0) -> None:
        """``nbytes`` more are held from now on (negative: freed); ``transient`` more for a moment."""
        self.live += nbytes
        self.peak = max(self.peak, self.live + transient)


class InFlight:
    """Reductions launched and not yet retired, oldest first, with the caller's bytes each holds."""

    def __init__(self, grad_bytes: GradBytes):
        self.grad_bytes = grad_bytes
        self.pending: Deque[Tuple[Reduction, int]] = deque()

    def start(self, reduction: Reduction, caller_bytes: int) -> None:
        self.pending.append((reduction, caller_bytes))
        self.grad_bytes.hold(reduction.nbytes)

    def retire_oldest(self) -> None:
        """Wait for the oldest reduction, add its result in, free its temporaries."""
        reduction, caller_bytes = self.pending.popleft()
        self.grad_bytes.hold(0, reduction.finish_bytes - caller_bytes)  # input dropped before finishing
        reduction.wait()
        self.grad_bytes.hold(-caller_bytes - reduction.nbytes)

    def retire(self, keep: int = 0) -> None:
        """Retire reductions until at most ``keep`` are in flight."""
        while len(self.pending) > keep:
            self.retire_oldest()

    def retire_finished(self) -> None:
        """Retire the reductions that are already over (never blocks)."""
        while self.pending and self.pending[0][0].done():
            self.retire_oldest()


class _Reducer:
    """The hooks, the bookkeeping and the once-per-step sums shared by both reducers."""

    def __init__(self, storage: FlatStorage, overlap: bool, on_bucket_complete: Callable[[Bucket], None]):
        self.storage, self.mesh, self.overlap = storage, storage.mesh, overlap
        self.buckets = storage.buckets
        self.on_bucket_complete = on_bucket_complete
        self.progress = [BucketProgress() for _ in self.buckets]
        self.location = {id(p): (b, s, i) for b in self.buckets for i, (p, s) in enumerate(zip(b.params, b.starts))}
        self.grad_bytes = GradBytes(storage.grads.untyped_storage().nbytes())
        self.in_flight = InFlight(self.grad_bytes)
        self.synced = True  # False from the first gradient until finish_grad_sync
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            return
        b, start, i = self.location[id(p)]
        self._accumulate(b, start, i, p.grad.reshape(-1))
        p.grad = None
        self.synced = False
        prog = self.progress[b.index]
        prog.arrived += 1
        if prog.arrived == len(b.params):
            prog.arrived = 0
            self.on_bucket_complete(b)
            self._bucket_complete(b)

    def _flush_incomplete(self) -> None:
        """Buckets the last backward left incomplete (unused parameters) are reduced as they are."""
        for b in self.buckets:
            if self.progress[b.index].arrived:
                self.progress[b.index].arrived = 0
                self._reduce_incomplete(b)

    def finish_grad_sync(self) -> None:
        self._drain()
        mesh, storage = self.mesh, self.storage
        if mesh.tp_size > 1:
            for b in self.buckets:
                if b.kind == "sequence_parallel":
                    dist.all_reduce(storage.updated_grads(b), group=mesh.tp_group)
        if mesh.pp_size > 1 and mesh.in_embedding_group:
            for b in self.buckets:
                if b.kind == "shared_embedding":
                    dist.all_reduce(storage.updated_grads(b), group=mesh.embedding_group)
        self.synced = True

    def end_step(self) -> None:
        """The step consumed the gradients: stages 0/1 may reduce every bucket again."""
        for prog in self.progress:
            prog.reduced = False

    def zero_grad(self) -> None:
        """Clear the accumulated gradients for the next step."""
        self.in_flight.retire()  # nothing may still write into the buffers zeroed below
        for b, prog in zip(self.buckets, self.progress):
            if prog.partial is not None:
                self.grad_bytes.hold(-prog.partial.nbytes)
            for p in b.params:
                p.grad = None
        self.progress = [BucketProgress() for _ in self.buckets]
        self.storage.grads.zero_()

    def partial_buffers(self) -> List[torch.Tensor]:
        return [prog.partial for prog in self.progress if prog.partial is not None]


class LastMicroBatchReducer(_Reducer):
    """Stages 0/1 (see the module docstring)."""

    def __init__(self, storage: FlatStorage, overlap: bool, on_bucket_complete, num_chunks: int):
        super().__init__(storage, overlap, on_bucket_complete)
        self.last_microbatch = [True] * num_chunks

    def _accumulate(self, b: Bucket, start: int, i: int, grad: torch.Tensor) -> None:
        self.storage.full_grads(b)[start:start + grad.numel()].add_(grad)

    def _bucket_complete(self, b: Bucket) -> None:
        if self.overlap and self.last_microbatch[b.chunk]:
            self._launch(b)  # without overlap, finish_grad_sync launches every bucket

    def _reduce_incomplete(self, b: Bucket) -> None:
        if self.last_microbatch[b.chunk]:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        prog, storage = self.progress[b.index], self.storage
        if prog.reduced:
            return
        prog.reduced = True
        dp, group = self.mesh.dp_size, self.mesh.dp_group
        if dp == 1:
            return
        full = storage.full_grads(b)
        if not shards_optimizer(storage.stage):  # stage 0: every rank keeps the whole mean, in place
            self.in_flight.start(all_reduce_mean(full, group, dp), 0)
        else:  # stage 1: one receive buffer at a time
            self.in_flight.retire()
            self.in_flight.start(reduce_scatter(storage.updated_grads(b), full, group, 1.0 / dp), 0)

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        self._flush_incomplete()
        self.last_microbatch[chunk_index] = bool(is_last_microbatch)
        self.synced = False

    def _drain(self) -> None:
        self._flush_incomplete()
        for b in self.buckets:
            self._launch(b)  # buckets not launched yet (no overlap, never completed in a last backward)
        self.in_flight.retire()


class EveryMicroBatchReducer(_Reducer):
    """Stages 2/3 (see the module docstring)."""

    def _accumulate(self, b: Bucket, start: int, i: int, grad: torch.Tensor) -> None:
        prog = self.progress[b.index]
        if prog.partial is None:  # a fresh bucket: each gradient is copied in, not added to zeros
            self.in_flight.retire_finished()
            prog.partial = torch.empty(b.numel, dtype=self.storage.grads.dtype, device=self.mesh.device)
            self.grad_bytes.hold(prog.partial.nbytes)
            prog.partial[b.starts[-1] + b.shapes[-1].numel():].zero_()  # padding
            prog.written = [False] * len(b.params)
        dst = prog.partial[start:start + grad.numel()]
        if prog.written[i]:
            dst.add_(grad)
        else:
            dst.copy_(grad)
            prog.written[i] = True

    def _bucket_complete(self, b: Bucket) -> None:
        self._launch(b)
        if not self.overlap:
            self.in_flight.retire()

    def _reduce_incomplete(self, b: Bucket) -> None:
        self._launch(b)

    def _launch(self, b: Bucket) -> None:
        prog = self.progress[b.index]
        partial, prog.partial = prog.partial, None
        if partial is None:
            return
        for start, shape, written in zip(b.starts, b.shapes, prog.written):
            if not written:  # no gradient in this backward (unused parameter)
                partial[start:start + shape.numel()].zero_()
        shard, dp = self.storage.updated_grads(b), self.mesh.dp_size
        if dp == 1:
            shard.add_(partial)
            self.grad_bytes.hold(-partial.nbytes)
            return
        self.in_flight.retire()  # one reduction in flight while the next bucket fills
        self.in_flight.start(reduce_scatter(shard, partial, self.mesh.dp_group, 1.0 / dp, accumulate=True),
                             partial.nbytes)

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        self._drain()  # the previous backward's reductions: frees their partial buffers
        self.synced = False

    def _drain(self) -> None:
        self._flush_incomplete()
        self.in_flight.retire()
