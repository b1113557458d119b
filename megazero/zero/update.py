"""The optimizer update on this rank's slice of every bucket, in fp32, optionally on the CPU.

For each bucket: the fp32 master weights of the updated range (the compute-dtype parameters
themselves when training in fp32 without offload), the optimizer's moments, the ranges that get
weight decay (matrices, not biases and norms) and the pieces of the owned DP slice that count in
the global gradient norm.  ``--offload-optimizer`` keeps masters and moments in host memory: the
reduced gradients go to the CPU, the updated weights come back.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megazero.clip import counts_in_norm
from megazero.zero.buffers import Bucket
from megazero.zero.flat_optim import build_flat_optimizer
from megazero.zero.storage import FlatStorage


class ShardedUpdate:
    """Master weights, optimizer state and the update for every bucket of ``storage``."""

    def __init__(self, storage: FlatStorage, opt_cfg, dtype: torch.dtype, offload: bool, tp_rank: int):
        self.storage, self.offload, self.tp_rank = storage, offload, tp_rank
        self.device = torch.device("cpu") if offload else torch.device(storage.mesh.device)
        self.separate_master = offload or dtype != torch.float32
        self.optim = build_flat_optimizer(opt_cfg)
        self.master: Dict[int, torch.Tensor] = {}
        self.state: Dict[int, Dict[str, torch.Tensor]] = {}
        self.decay: Dict[int, List[Tuple[int, int]]] = {}
        self.norm_pieces: Dict[int, List[Tuple[int, int, bool]]] = {}

    def add_bucket(self, b: Bucket, full: torch.Tensor) -> None:
        """Set up bucket ``b`` from its full fp32 values (after ``storage.adopt``)."""
        lo, hi = self.storage.updated_range(b)
        if self.separate_master:
            self.master[b.index] = full[lo:hi].to(self.device, copy=True)
        else:
            self.master[b.index] = self.storage.updated_params(b)  # fp32 params are their own masters
        self.state[b.index] = self.optim.init_state(self.master[b.index])
        self.decay[b.index] = _merge([(a - lo, e - lo) for p, a, e in b.segments(lo, hi) if p.dim() > 1])
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

    def apply(self, b: Bucket, lr: float, step: int, grad_mul: float) -> None:
        """Optimizer step number ``step`` on bucket ``b``; the compute-dtype parameters of the
        updated range follow the masters."""
        grad = self.storage.updated_grads(b).to(self.device, torch.float32)  # fp32 grads: no copy
        master = self.master[b.index]
        self.optim.update(master, grad, self.state[b.index], self.decay[b.index], lr, step,
                          grad_mul=grad_mul)
        self.publish(b)

    def publish(self, b: Bucket) -> None:
        """Copy bucket ``b``'s masters into the compute-dtype parameters of the updated range."""
        params = self.storage.updated_params(b)
        if params.data_ptr() != self.master[b.index].data_ptr():
            params.copy_(self.master[b.index])

    def tensors(self) -> List[torch.Tensor]:
        """Every master and moment tensor (for memory accounting)."""
        return list(self.master.values()) + [t for s in self.state.values() for t in s.values()]


def _merge(segments):
    out = []
    for a, e in segments:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out
