"""Gradient synchronisation over the data-parallel axis: what happens to a bucket during backward.

Gradients reach the flat buffers in one of two ways: a linear layer's weight gets
``param.write_grad``, through which its backward writes the gradient straight into the weight's
slice (:func:`megazero.tensor_parallel.layers.linear`; a bf16/fp16 weight's product is added into
fp32 main gradients); every other parameter's ``param.grad`` is added in by a
``post_accumulate_grad`` hook and dropped.  When all of a bucket's parameters have their gradient,
the bucket is *complete* and its reduction can start while backward goes on:

- :class:`LastMicroBatchReducer` (stages 0/1): gradients accumulate in the full buffer over the
  micro-batches; each bucket is reduced once, in the last micro-batch's backward (an all-reduce
  at stage 0, a reduce-scatter into the owned slice at stage 1);
- :class:`EveryMicroBatchReducer` (stages 2/3): each backward collects a bucket's gradients in a
  full-bucket *partial* buffer that is reduce-scattered and added into the gradient shard.

Gradient memory in flight is bounded (:class:`InFlight`): at most ``--max-reductions-in-flight``
(K, default 2) reductions that hold temporaries run at once; before another is launched the
oldest is waited for and retired (its slice added into the shard, its temporaries freed), and
finished ones are retired as soon as the next bucket starts.  Stage 0's in-place all-reduces hold
nothing and are not limited.  So the gradient bytes never exceed the persistent buffer plus
``1 + 2K`` buckets on gloo (a partial bucket filling, and per reduction its input and receive
buffer) or ``1 + K`` with a native reduce-scatter (stage 1: ``K`` receive buffers).
``finish_grad_sync`` waits for everything and does the once-per-step sums over TP
(sequence-parallel parameters) and the embedding group (tied embeddings); summing the
DP-reduced slice over those groups equals reducing the summed gradient, as bucket layouts match
across them.  With ``--no-overlap-grad-reduce`` stages 0/1 reduce after the last backward;
stages 2/3 reduce each bucket when it completes and wait for it.

No pass over the buffers is spent on zeroing: ``zero_grad`` only forgets what was written.  The
first gradient of a parameter in a step is copied into the buffer (later ones are added), the
first reduction of a bucket in a step writes the shard (later ones add to it), and whatever got
no gradient at all in the step (unused parameters) is zeroed when its bucket is reduced.
"""
from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from megazero.zero.buckets import Bucket
from megazero.zero.comm import Reduction, all_reduce_mean, reduce_row_pieces, reduce_rows, reduce_scatter
from megazero.zero.stages import shards_optimizer
from megazero.zero.storage import FlatStorage


class GradSync(Protocol):
    """What the pipeline executor and the trainer call on the optimizer around backward."""

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        """Before each backward of model chunk ``chunk_index``."""

    def finish_grad_sync(self) -> None:
        """After the schedule: every reduction done, gradients ready for the step."""

    def defer_weight_grads(self) -> None:
        """Until :meth:`compute_deferred_weight_grads`: linear layers' weight gradients are queued,
        not computed (``--delay-wgrad-compute``)."""

    def compute_deferred_weight_grads(self) -> None:
        """Compute the queued weight gradients (before the next backward and the step)."""

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without fp16)."""


@dataclass
class BucketProgress:
    """A bucket's state during the current step."""
    arrived: int = 0                        # gradients received in the current backward
    reduced: bool = False                   # stages 0/1: reduction launched in this step
    partial: Optional[torch.Tensor] = None  # stages 2/3: this backward's gradients, full bucket
    # which parameters have a gradient in their buffer: the full buffer this step (stages 0/1),
    # ``partial`` this backward (stages 2/3)
    written: List[bool] = field(default_factory=list)
    shard_written: bool = False             # stages 2/3: a reduction wrote the shard this step


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

    def __init__(self, storage: FlatStorage, overlap: bool, on_bucket_complete: Callable[[Bucket], None],
                 max_in_flight: int = 2):
        if max_in_flight < 1:
            raise ValueError(f"--max-reductions-in-flight must be at least 1, got {max_in_flight}")
        self.storage, self.mesh, self.overlap = storage, storage.mesh, overlap
        self.max_in_flight = max_in_flight
        # every bucket's reduction is the mean over the dense data ranks (dp x cp): dense buckets sum over
        # them, expert buckets over expert DP, whose ranks together saw the same tokens (Megatron-core's
        # expert gradient scaling)
        self.scale = 1.0 / storage.mesh.size("dp", "cp")
        self.buckets = storage.buckets
        self.on_bucket_complete = on_bucket_complete
        self.progress = [BucketProgress() for _ in self.buckets]
        self.location = {id(p): (b, s, i) for b in self.buckets
                         for i, (p, s) in enumerate(zip(b.params, b.starts))}
        self.grad_bytes = GradBytes(storage.grads.untyped_storage().nbytes())
        self.in_flight = InFlight(self.grad_bytes)
        self.synced = True  # False from the first gradient until finish_grad_sync
        self.deferred: Optional[List[Tuple[torch.nn.Parameter, Callable]]] = None  # --delay-wgrad-compute
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                      for b in self.buckets for p in b.params]
        # gradient parts per backward and bucket: one per parameter, except that a weight with
        # ``grad_arrivals = 2`` (the tied embedding in one chunk) gets its output head's part through
        # write_grad and its lookup's through .grad
        self.expected = [len(b.params) for b in self.buckets]
        for b in self.buckets:  # linear layers' weights: their backward writes into the buffer itself
            for p in b.params:
                if getattr(p, "linear_weight", False) and storage.grads.dtype.is_floating_point:
                    p.write_grad = functools.partial(self._write_grad, p)
                elif getattr(p, "grad_arrivals", 1) == 2 and p.dtype == storage.grads.dtype:
                    p.write_grad = functools.partial(self._write_grad, p)
                    self.expected[b.index] += 1

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:  # the weight's gradient went straight into the buffer (write_grad)
            return
        grad, p.grad = p.grad, None
        b = self.location[id(p)][0]
        if grad.is_sparse and self._rows(b, grad):  # reduced as rows: no gradient of the weight's size
            self._arrived(b)
            return
        grad = (grad.to_dense() if grad.is_sparse else grad).reshape(-1)
        if self._take(b, grad):  # the gradient itself becomes the bucket's buffer: no copy
            self._arrived(b)
            return
        self._write_grad(p, lambda dst, accumulate: dst.add_(grad) if accumulate else dst.copy_(grad))

    def _take(self, b: Bucket, grad: torch.Tensor) -> bool:
        """Stages 2/3: make ``grad`` (the whole of bucket ``b``) its fresh partial buffer, if it can."""
        return False

    def _rows(self, b: Bucket, grad: torch.Tensor) -> bool:
        """Stages 2/3: reduce the sparse ``grad`` of bucket ``b``'s one parameter as rows, if it can."""
        return False

    def _write_grad(self, p: torch.nn.Parameter, write: Callable[[torch.Tensor, bool], None]) -> None:
        """``write(dst, accumulate)`` puts ``p``'s gradient of this backward into ``dst`` (its flat
        slice), added to what is there when ``accumulate`` (overwriting it otherwise); then the
        bucket's bookkeeping as for a gradient arriving through ``.grad``.  Between
        :meth:`defer_weight_grads` and :meth:`compute_deferred_weight_grads` it is only queued."""
        if self.deferred is not None:
            self.deferred.append((p, write))
            return
        b, start, i = self.location[id(p)]
        if not self._write_pieces(b, write):
            dst, accumulate = self._destination(b, start, i, p.numel())
            write(dst, accumulate)
        self._arrived(b)

    def defer_weight_grads(self) -> None:
        """Queue the weight gradients that linear layers hand to ``write_grad`` from now on."""
        if self.deferred is None:
            self.deferred = []

    def compute_deferred_weight_grads(self) -> None:
        """Compute the queued weight gradients, in the order their backward handed them over, and
        stop queueing."""
        queued, self.deferred = self.deferred or [], None
        with torch.no_grad():  # outside the autograd engine: the saved inputs still require grad
            for p, write in queued:
                self._write_grad(p, write)

    def _write_pieces(self, b: Bucket, write) -> bool:
        """Stages 2/3: reduce the gradient ``write`` computes (all of bucket ``b``) a piece of rows at
        a time, if it can."""
        return False

    def _arrived(self, b: Bucket) -> None:
        """One gradient part of bucket ``b`` is in: the bucket is complete after the last part; a
        bucket of one parameter used twice reduces each part as it arrives (stages 2/3)."""
        self.synced = False
        prog = self.progress[b.index]
        prog.arrived += 1
        if prog.arrived == self.expected[b.index]:
            prog.arrived = 0
            self.on_bucket_complete(b)
            self._bucket_complete(b)
        elif len(b.params) == 1:
            self._part_complete(b)

    def _part_complete(self, b: Bucket) -> None:
        """A part of a one-parameter bucket arrived, more are to come (stages 0/1 wait for them)."""

    def _flush_incomplete(self) -> None:
        """Buckets the last backward left incomplete (unused parameters) are reduced as they are."""
        for b in self.buckets:
            if self.progress[b.index].arrived:
                self.progress[b.index].arrived = 0
                self._reduce_incomplete(b)

    def finish_grad_sync(self) -> None:
        self._drain()
        mesh, storage = self.mesh, self.storage
        if mesh.size("tp") > 1:
            for b in self.buckets:
                if b.kind == "sequence_parallel":
                    dist.all_reduce(storage.updated_grads(b), group=mesh.group("tp"))
        if mesh.size("pp") > 1 and mesh.in_embedding_group:
            for b in self.buckets:
                if b.kind == "shared_embedding":
                    dist.all_reduce(storage.updated_grads(b), group=mesh.group("embedding"))
        self.synced = True

    def end_step(self) -> None:
        """The step consumed the gradients: stages 0/1 may reduce every bucket again."""
        for prog in self.progress:
            prog.reduced = False

    def zero_grad(self) -> None:
        """Start a new step: what the buffers hold is forgotten (overwritten by the first gradient,
        zeroed where none arrives), not zeroed here."""
        self.in_flight.retire()  # nothing may still write into the buffers
        for b, prog in zip(self.buckets, self.progress):
            if prog.partial is not None:
                self.grad_bytes.hold(-prog.partial.nbytes)
            for p in b.params:
                p.grad = None
        self.progress = [BucketProgress() for _ in self.buckets]
        self.synced = False  # even a step without backward syncs (and so zeroes) its gradients

    def _retire_for_launch(self) -> None:
        """Make room for one more reduction: at most ``max_in_flight`` run at once."""
        self.in_flight.retire(keep=self.max_in_flight - 1)

    def partial_buffers(self) -> List[torch.Tensor]:
        return [prog.partial for prog in self.progress if prog.partial is not None]


class LastMicroBatchReducer(_Reducer):
    """Stages 0/1 (see the module docstring)."""

    def __init__(self, storage: FlatStorage, overlap: bool, on_bucket_complete, num_chunks: int,
                 max_in_flight: int = 2):
        super().__init__(storage, overlap, on_bucket_complete, max_in_flight)
        self.last_microbatch = [True] * num_chunks

    def _destination(self, b: Bucket, start: int, i: int, numel: int) -> Tuple[torch.Tensor, bool]:
        prog = self.progress[b.index]
        if not prog.written:
            prog.written = [False] * len(b.params)
        accumulate, prog.written[i] = prog.written[i], True  # the step's first gradient overwrites
        return self.storage.full_grads(b)[start:start + numel], accumulate

    def _zero_unwritten(self, b: Bucket) -> None:
        """Parameters of ``b`` without a gradient this step hold stale values: zero them."""
        written, full = self.progress[b.index].written, self.storage.full_grads(b)
        for i, (start, shape) in enumerate(zip(b.starts, b.shapes)):
            if not (written and written[i]):
                full[start:start + shape.numel()].zero_()

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
        self._zero_unwritten(b)
        scale, group = self.scale, self.mesh.group(*b.group)
        full = storage.full_grads(b)
        if b.dp == 1:
            if scale != 1.0:  # experts without expert DP still average over the dense data ranks
                full.mul_(scale)
            return
        if not shards_optimizer(storage.stage):  # stage 0: every rank keeps the whole mean, in place
            self.in_flight.start(all_reduce_mean(full, group, self.mesh.size("dp", "cp")), 0)
        else:  # stage 1: a receive buffer per reduction in flight (gloo)
            self._retire_for_launch()
            self.in_flight.start(reduce_scatter(storage.updated_grads(b), full, group, scale), 0)

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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the tied embedding alone in its bucket: its lookup's part as rows, on the host only (how
        # many rows each rank has is read there; on an accelerator that read would stall the queue
        # once per micro-batch, so there the part stays dense)
        host = self.storage.grads.device.type == "cpu"
        for b in self.buckets:
            if len(b.params) == 1 and self.expected[b.index] > 1 and host:
                b.params[0].sparse_grad = True

    def _write_pieces(self, b: Bucket, write) -> bool:
        """The head's part of the tied embedding (a bucket of its own, several ranks, nothing of it
        pending): computed and reduced a piece of rows at a time into the shard
        (:func:`megazero.zero.comm.reduce_row_pieces`), no buffer of the embedding's size."""
        prog = self.progress[b.index]
        if (len(b.params) != 1 or self.expected[b.index] == 1 or b.dp == 1 or prog.partial is not None
                or getattr(write, "rows", None) is None or len(write.shape) != 2):
            return False
        self.in_flight.retire()  # the reductions in flight first, as a blocking reduction of a part does
        accumulate, prog.shard_written = prog.shard_written, True
        rows, width = write.shape
        reduce_row_pieces(self.storage.updated_grads(b), b.shard_range(self.storage.rank_of(b))[0], rows,
                          width, write.rows, self.mesh.group(*b.group), self.scale, accumulate)
        return True

    def _rows(self, b: Bucket, grad: torch.Tensor) -> bool:
        """The lookup's part of the tied embedding: every rank's rows added into the shard
        (:func:`megazero.zero.comm.reduce_rows`); neither a full-size gradient nor a partial buffer."""
        if len(b.params) != 1 or grad.dim() != 2 or b.starts[0] != 0:
            return False
        prog = self.progress[b.index]
        accumulate, prog.shard_written = prog.shard_written, True
        lo = b.shard_range(self.storage.rank_of(b))[0]
        reduce_rows(self.storage.updated_grads(b), lo, grad._indices()[0], grad._values(),
                    self.mesh.group(*b.group) if b.dp > 1 else None, self.scale, accumulate)
        return True

    def _destination(self, b: Bucket, start: int, i: int, numel: int) -> Tuple[torch.Tensor, bool]:
        prog = self.progress[b.index]
        if prog.partial is None:  # a fresh bucket: each gradient is written in, not added to zeros
            self.in_flight.retire_finished()
            prog.partial = torch.empty(b.numel, dtype=self.storage.grads.dtype, device=self.mesh.device)
            self.grad_bytes.hold(prog.partial.nbytes)
            prog.partial[b.starts[-1] + b.shapes[-1].numel():].zero_()  # padding
            prog.written = [False] * len(b.params)
        accumulate, prog.written[i] = prog.written[i], True
        return prog.partial[start:start + numel], accumulate

    def _take(self, b: Bucket, grad: torch.Tensor) -> bool:
        prog = self.progress[b.index]
        if (prog.partial is not None or len(b.params) != 1 or grad.numel() != b.numel
                or grad.dtype != self.storage.grads.dtype or grad.device != self.storage.grads.device
                or not grad.is_contiguous()):
            return False
        self.in_flight.retire_finished()
        prog.partial, prog.written = grad, [True]
        self.grad_bytes.hold(grad.nbytes)
        return True

    def _bucket_complete(self, b: Bucket) -> None:
        self._launch(b)
        if not self.overlap:
            self.in_flight.retire()

    def _part_complete(self, b: Bucket) -> None:
        """Reduced into the shard now (in pieces, :func:`megazero.zero.comm.reduce_scatter` with
        ``blocking``), so that its buffer is gone before the backward goes on (the tied embedding's
        head part: an embedding-sized buffer); the next part starts a fresh one."""
        self._launch(b)

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
        shard, scale = self.storage.updated_grads(b), self.scale
        accumulate, prog.shard_written = prog.shard_written, True  # the step's first reduction writes
        if b.dp == 1:
            if accumulate:
                shard.add_(partial, alpha=scale)
            else:
                shard.copy_(partial)
                if scale != 1.0:
                    shard.mul_(scale)
            self.grad_bytes.hold(-partial.nbytes)
            return
        self._retire_for_launch()
        # a parameter used twice (the tied embedding alone in its bucket): each part is reduced in
        # pieces and waited for, no full-bucket receive buffer beside the embedding-sized part
        blocking = self.expected[b.index] > len(b.params)
        self.in_flight.start(reduce_scatter(shard, partial, self.mesh.group(*b.group), scale,
                                            accumulate=accumulate, blocking=blocking),
                             partial.nbytes)
        if blocking:
            self.in_flight.retire()

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        self._drain()  # the previous backward's reductions: frees their partial buffers
        self.synced = False

    def _drain(self) -> None:
        self._flush_incomplete()
        self.in_flight.retire()

    def finish_grad_sync(self) -> None:
        self._drain()
        for b, prog in zip(self.buckets, self.progress):
            if not prog.shard_written:  # no gradient at all this step
                self.storage.updated_grads(b).zero_()
                prog.shard_written = True
        super().finish_grad_sync()
