"""The optimizer update on this rank's slice of every bucket, in fp32, optionally on the CPU.

For each bucket: the fp32 master weights of the updated range (the compute-dtype parameters
themselves when training in fp32 without offload), the optimizer's moments, the ranges that get
weight decay (matrices, not biases and norms) and the pieces of the owned DP slice that count in
the global gradient norm.  ``--offload-optimizer`` keeps masters and moments in host memory: the
reduced gradients go to the CPU, the updated weights come back.

Offloading from a GPU (untested: no GPU was available when this was written) is pipelined per
bucket: every bucket's gradients leave at once with ``non_blocking`` copies into pinned staging
buffers (the copy engine runs them back to back, each followed by an event), each CPU update
waits only for its own bucket's event, and its new weights go back with a ``non_blocking`` copy
from pinned masters on the current stream (so the all-gather and the next forward, ordered after
it, see them); before a master is written again its previous upload is waited for.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megazero.clip import counts_in_norm
from megazero.zero.buckets import Bucket
from megazero.zero.flat_optim import build_flat_optimizer
from megazero.zero.storage import FlatStorage

LR = Tuple[float, Optional[float]]  # (rate, rate of the embedding and output weights; None: the same)


class ShardedUpdate:
    """Master weights, optimizer state and the update for every bucket of ``storage``."""

    def __init__(self, storage: FlatStorage, opt_cfg, dtype: torch.dtype, offload: bool, tp_rank: int):
        self.storage, self.offload, self.tp_rank = storage, offload, tp_rank
        self.device = torch.device("cpu") if offload else torch.device(storage.mesh.device)
        self.separate_master = offload or dtype != torch.float32
        self.pinned = offload and storage.mesh.device.type == "cuda"  # host <-> GPU copies to pipeline
        self.staging: Dict[int, torch.Tensor] = {}  # pinned fp32 gradients per bucket (GPU offload)
        self.uploads: Dict[int, object] = {}  # bucket -> CUDA event of its last master -> param copy
        self.optim = build_flat_optimizer(opt_cfg)
        self.master: Dict[int, torch.Tensor] = {}
        self.state: Dict[int, Dict[str, torch.Tensor]] = {}
        self.decay: Dict[int, List[Tuple[int, int]]] = {}
        self.decoupled: Dict[int, List[Tuple[int, int]]] = {}  # ranges of embedding/output weights
        self.norm_pieces: Dict[int, List[Tuple[int, int, bool]]] = {}

    def add_bucket(self, b: Bucket, full: torch.Tensor) -> None:
        """Set up bucket ``b`` from its full fp32 values (after ``storage.adopt``)."""
        lo, hi = self.storage.updated_range(b)
        if self.pinned:
            self.master[b.index] = torch.empty(hi - lo, dtype=torch.float32,
                                               pin_memory=True).copy_(full[lo:hi])
        elif self.separate_master:
            self.master[b.index] = full[lo:hi].to(self.device, copy=True)
        else:
            self.master[b.index] = self.storage.updated_params(b)  # fp32 params are their own masters
        self.state[b.index] = self.optim.init_state(self.master[b.index])
        self.decay[b.index] = _merge([(a - lo, e - lo) for p, a, e in b.segments(lo, hi) if p.dim() > 1])
        self.decoupled[b.index] = _merge([(a - lo, e - lo) for p, a, e in b.segments(lo, hi)
                                          if getattr(p, "is_embedding_or_output_parameter", False)])
        self.norm_pieces[b.index] = self._norm_pieces(b)

    def _norm_pieces(self, b: Bucket) -> List[Tuple[int, int, bool]]:
        """``(a, e, counted)`` runs over the owned DP slice; adjacent runs with one flag merged."""
        pieces: List[Tuple[int, int, bool]] = []
        for p, a, e in b.segments(*b.shard_range(self.storage.dp_rank)):
            counted = counts_in_norm(p, self.tp_rank)
            if pieces and pieces[-1][1] == a and pieces[-1][2] == counted:
                pieces[-1] = (pieces[-1][0], e, counted)
            else:
                pieces.append((a, e, counted))
        return pieces

    def grad_norm_pieces(self):
        """``(gradient slice, counted)`` for every norm piece of every bucket."""
        return [(self.storage.grad_slice(b, a, e), counted)
                for b in self.storage.buckets for a, e, counted in self.norm_pieces[b.index]]

    def apply(self, b: Bucket, lr: LR, step: int, grad_mul: float) -> None:
        """Optimizer step number ``step`` on bucket ``b`` with ``lr`` = (rate, rate of the embedding and
        output weights or None: the same); the compute-dtype parameters of the updated range follow
        the masters."""
        grad = self.storage.updated_grads(b).to(self.device, torch.float32)  # fp32 grads: no copy
        self._update(b, grad, lr, step, grad_mul)

    def apply_all(self, buckets: Sequence[Bucket], lr: LR, step: int, grad_mul: float) -> Iterator[Bucket]:
        """:meth:`apply` on ``buckets`` in order, yielding each once its parameters are updated
        (stream-ordered on a GPU).  Offloading from a GPU, every gradient download starts first."""
        if not self.pinned:
            for b in buckets:
                self.apply(b, lr, step, grad_mul)
                yield b
            return
        downloads = [self._download(b) for b in buckets]
        for b, done in zip(buckets, downloads):
            done.synchronize()
            self._update(b, self.staging[b.index], lr, step, grad_mul)
            yield b

    def _download(self, b: Bucket):
        """Start copying bucket ``b``'s reduced gradients into pinned host memory; returns the event
        that marks the copy done."""
        grads = self.storage.updated_grads(b)
        if b.index not in self.staging:
            self.staging[b.index] = torch.empty(grads.numel(), dtype=torch.float32, pin_memory=True)
        self.staging[b.index].copy_(grads, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def _update(self, b: Bucket, grad: torch.Tensor, lr: LR, step: int, grad_mul: float) -> None:
        upload = self.uploads.pop(b.index, None)
        if upload is not None:  # the master is about to change: its last upload must be over
            upload.synchronize()
        rate, decoupled_rate = lr
        decoupled = (self.decoupled[b.index], decoupled_rate) if decoupled_rate is not None else None
        self.optim.update(self.master[b.index], grad, self.state[b.index], self.decay[b.index], rate, step,
                          grad_mul=grad_mul, decoupled=decoupled)
        self.publish(b)

    def publish(self, b: Bucket) -> None:
        """Copy bucket ``b``'s masters into the compute-dtype parameters of the updated range."""
        params = self.storage.updated_params(b)
        if params.data_ptr() == self.master[b.index].data_ptr():
            return
        if not self.pinned:
            params.copy_(self.master[b.index])
            return
        params.copy_(self.master[b.index], non_blocking=True)
        self.uploads[b.index] = torch.cuda.Event()
        self.uploads[b.index].record()

    def tensors(self) -> List[torch.Tensor]:
        """Every master and moment tensor (for memory accounting; the staging is not optimizer state)."""
        return list(self.master.values()) + [t for s in self.state.values() for t in s.values()]


def _merge(segments):
    out = []
    for a, e in segments:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out
