"""The flat buffers behind the parameters and gradients of one rank.

=====  ==========================================  ============================================
stage  parameters (compute dtype)                  gradients (``--grad-reduce-dtype``)
=====  ==========================================  ============================================
0, 1   one full flat buffer; parameters are views  one full flat buffer
2      one full flat buffer; parameters are views  this rank's shard of every bucket
3      this rank's shard of every bucket           this rank's shard of every bucket
=====  ==========================================  ============================================

Every bucket is padded to a multiple of the size of the group it is reduced over (dp x cp; expert DP
for the experts' buckets), so rank ``r`` of that group owns the same contiguous slice of every such
bucket (:meth:`Bucket.shard_range`).  The optimizer updates the *updated range*
of a bucket: all of it at stage 0 (every rank steps the whole model), the owned slice otherwise.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from megazero.process.distributed import gather_shards
from megazero.zero.buckets import Bucket
from megazero.zero.stages import shards_gradients, shards_optimizer, shards_parameters


class FlatStorage:
    """Flat parameter and gradient buffers for ``buckets`` (see the module docstring)."""

    def __init__(self, buckets: List[Bucket], stage: int, mesh, dtype: torch.dtype, grad_dtype: torch.dtype,
                 param_swap=None):
        self.buckets, self.stage, self.mesh = buckets, stage, mesh
        self.swap = param_swap  # stage 3 with --offload-param-device nvme: shards on disk (ParamSwap)
        self.dp_rank, self.dp_size = mesh.coord("dp", "cp"), mesh.size("dp", "cp")
        self._ranks = {g: mesh.coord(*g) for g in {b.group for b in buckets}}
        total = sum(b.numel for b in buckets)
        shard_total = sum(b.shard_numel for b in buckets)
        self.sharded_params = shards_parameters(stage)
        self.sharded_grads = shards_gradients(stage)
        numel = 0 if param_swap is not None else shard_total if self.sharded_params else total
        self.params = torch.zeros(numel, dtype=dtype, device=mesh.device)
        self._grad_shape = (shard_total if self.sharded_grads else total, grad_dtype)
        # parameters on NVMe: the gradient buffer comes once the model's own tensors are released
        # (allocate_grads), so start-up never holds both
        self.grads = torch.zeros(0, dtype=grad_dtype, device=mesh.device)
        if param_swap is None:
            self.allocate_grads()

    def rank_of(self, b: Bucket) -> int:
        """This rank's index in the group bucket ``b`` is sharded over."""
        return self._ranks[b.group]

    def allocate_grads(self) -> None:
        numel, dtype = self._grad_shape
        if self.grads.numel() != numel:
            self.grads = torch.zeros(numel, dtype=dtype, device=self.mesh.device)

    def adopt(self, b: Bucket, full: torch.Tensor) -> None:
        """Store bucket ``b``'s values (``full``: the whole padded bucket) and, unless parameters are
        sharded, make its parameters views of the flat buffer."""
        if self.swap is not None:
            lo, hi = b.shard_range(self.rank_of(b))
            self.swap.materialize(b.index).copy_(full[lo:hi])
            self.swap.flush(b.index)
            return
        if self.sharded_params:
            lo, hi = b.shard_range(self.rank_of(b))
            self.params[b.shard_offset:b.shard_offset + b.shard_numel].copy_(full[lo:hi])
            return
        self.params[b.offset:b.offset + b.numel].copy_(full)
        for p, s, shape in zip(b.params, b.starts, b.shapes):
            p.data = self.params[b.offset + s:b.offset + s + shape.numel()].view(shape)

    def updated_range(self, b: Bucket) -> Tuple[int, int]:
        """Bucket-local range the optimizer updates on this rank (all of it at stage 0)."""
        return b.shard_range(self.rank_of(b)) if shards_optimizer(self.stage) else (0, b.numel)

    def param_shard(self, b: Bucket) -> torch.Tensor:
        """Stage 3: this rank's shard of bucket ``b``'s parameters (on NVMe: its home tensor, valid
        while fetched)."""
        if self.swap is not None:
            return self.swap.homes[b.index]
        return self.params[b.shard_offset:b.shard_offset + b.shard_numel]

    def updated_params(self, b: Bucket) -> torch.Tensor:
        """The compute-dtype parameters of the updated range."""
        if self.sharded_params:
            return self.param_shard(b)
        lo, hi = self.updated_range(b)
        return self.params[b.offset + lo:b.offset + hi]

    def begin_update(self, b: Bucket) -> None:
        """Before the optimizer overwrites bucket ``b``'s updated parameters: give an NVMe shard memory."""
        if self.swap is not None:
            self.swap.materialize(b.index)

    def end_update(self, b: Bucket) -> None:
        """After: an NVMe shard is written back (and leaves memory once written)."""
        if self.swap is not None:
            self.swap.flush(b.index)

    def full_grads(self, b: Bucket) -> torch.Tensor:
        """Stages 0/1: the whole bucket's accumulated gradients."""
        return self.grads[b.offset:b.offset + b.numel]

    def updated_grads(self, b: Bucket) -> torch.Tensor:
        """The reduced gradients of the updated range (valid after the gradient sync)."""
        if self.sharded_grads:
            return self.grads[b.shard_offset:b.shard_offset + b.shard_numel]
        lo, hi = self.updated_range(b)
        return self.grads[b.offset + lo:b.offset + hi]

    def grad_slice(self, b: Bucket, a: int, e: int) -> torch.Tensor:
        """Reduced gradient of bucket-local ``[a, e)``, inside this rank's DP slice."""
        if self.sharded_grads:
            base = b.shard_offset - self.rank_of(b) * b.shard_numel
            return self.grads[base + a:base + e]
        return self.grads[b.offset + a:b.offset + e]

    def all_gather_params(self, b: Bucket, async_op: bool = False):
        """Stages 1/2: all-gather every rank's updated slice into the full parameter buffer (the
        work handle when ``async_op``; None when there is nothing to gather)."""
        if self.sharded_params or not shards_optimizer(self.stage) or b.dp == 1:
            return None
        full = self.params[b.offset:b.offset + b.numel]
        return gather_shards(full, self.updated_params(b), group=self.mesh.group(*b.group),
                             async_op=async_op)
