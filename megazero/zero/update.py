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

from megazero.optim.clip import counts_in_norm
from megazero.zero.buckets import Bucket
from megazero.zero.flat_optim import build_flat_optimizer
from megazero.zero.storage import FlatStorage

LR = Tuple[float, Optional[float]]  # (rate, rate of the embedding and output weights; None: the same)


class ShardedUpdate:
    """Master weights, optimizer state and the update for every bucket of ``storage``."""

    def __init__(self, storage: FlatStorage, opt_cfg, dtype: torch.dtype, offload: bool, tp_rank: int,
                 tiers: Optional[Dict[int, str]] = None, par=None):
        self.storage, self.tp_rank = storage, tp_rank
        # per bucket: "device" (the mesh's device), "cpu" (host memory) or "nvme" (NvmeTier)
        self.tier = tiers or {b.index: "cpu" if offload else "device" for b in storage.buckets}
        self.offload = any(t != "device" for t in self.tier.values())
        self.dtype = dtype
        self.pinned = self.offload and storage.mesh.device.type == "cuda"  # host <-> GPU copies to pipeline
        self.staging: Dict[int, torch.Tensor] = {}  # pinned fp32 gradients per bucket (GPU offload)
        self.uploads: Dict[int, object] = {}  # bucket -> CUDA event of its last master -> param copy
        self.optim = build_flat_optimizer(opt_cfg)
        self.master: Dict[int, torch.Tensor] = {}  # buckets in memory only
        self.state: Dict[int, Dict[str, torch.Tensor]] = {}
        self.decay: Dict[int, List[Tuple[int, int]]] = {}
        self.decoupled: Dict[int, List[Tuple[int, int]]] = {}  # ranges of embedding/output weights
        self.norm_pieces: Dict[int, List[Tuple[int, int, bool]]] = {}
        self.holds: Dict[int, object] = {}  # bucket -> event an --async-save sets once it has copied it
        self.nvme = None
        on_disk = {b.index: _length(storage.updated_range(b)) for b in storage.buckets
                   if self.tier[b.index] == "nvme"}
        if on_disk:
            from megazero.zero.nvme_tier import NvmeTier
            self.nvme = NvmeTier(on_disk, self.optim.state_names, par, storage.mesh)

    def _device(self, b: Bucket) -> torch.device:
        on_device = self.tier[b.index] == "device"
        return torch.device(self.storage.mesh.device) if on_device else torch.device("cpu")

    def add_bucket(self, b: Bucket, full: torch.Tensor) -> None:
        """Set up bucket ``b`` from its full fp32 values (after ``storage.adopt``)."""
        lo, hi = self.storage.updated_range(b)
        tier = self.tier[b.index]
        if tier == "nvme":
            self.nvme.init_bucket(b.index, full[lo:hi])
        else:
            if tier == "cpu" and self.pinned:
                self.master[b.index] = torch.empty(hi - lo, dtype=torch.float32,
                                                   pin_memory=True).copy_(full[lo:hi])
            elif tier == "cpu" or self.dtype != torch.float32 or self.storage.swap is not None:
                self.master[b.index] = full[lo:hi].to(self._device(b), copy=True)
            else:
                self.master[b.index] = self.storage.updated_params(b)  # fp32 params are their own masters
            self.state[b.index] = self.optim.init_state(self.master[b.index])
        shapes = {id(p): shape for p, shape in zip(b.params, b.shapes)}  # (ZeRO-3 parameters are empty)
        self.decay[b.index] = _merge([(a - lo, e - lo) for p, a, e in b.segments(lo, hi)
                                      if decays(p, shapes[id(p)])])
        self.decoupled[b.index] = _merge([(a - lo, e - lo) for p, a, e in b.segments(lo, hi)
                                          if getattr(p, "is_embedding_or_output_parameter", False)])
        self.norm_pieces[b.index] = self._norm_pieces(b)

    def _norm_pieces(self, b: Bucket) -> List[Tuple[int, int, bool]]:
        """``(a, e, counted)`` runs over the owned DP slice; adjacent runs with one flag merged."""
        pieces: List[Tuple[int, int, bool]] = []
        etp_rank = self.storage.mesh.coord("etp")
        for p, a, e in b.segments(*b.shard_range(self.storage.rank_of(b))):
            counted = counts_in_norm(p, self.tp_rank, etp_rank)
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
        """Optimizer step number ``step`` on bucket ``b`` (in memory) with ``lr`` = (rate, rate of the
        embedding and output weights or None: the same); the compute-dtype parameters of the updated
        range follow the masters."""
        grad = self.storage.updated_grads(b).to(self._device(b), torch.float32)  # fp32 grads: no copy
        self._update(b, grad, lr, step, grad_mul)

    def apply_all(self, buckets: Sequence[Bucket], lr: LR, step: int, grad_mul: float) -> Iterator[Bucket]:
        """:meth:`apply` on ``buckets`` in order, yielding each once its parameters are updated
        (stream-ordered on a GPU).  Offloading from a GPU, every gradient download starts first.
        Buckets on NVMe stream their sub-groups (read ahead, write back) through the same loop."""
        downloads = {b.index: self._download(b) for b in buckets
                     if self.pinned and self.tier[b.index] == "cpu"}
        on_disk = [b.index for b in buckets if self.tier[b.index] == "nvme"]
        walk = self.nvme.walk(on_disk) if self.nvme else None
        try:
            for b in buckets:
                self._wait_hold(b.index)
                self.storage.begin_update(b)  # parameters on NVMe: the shard gets memory
                if self.tier[b.index] == "nvme":
                    for j in range(len(self.nvme.pieces[b.index])):
                        self._update_piece(b, j, next(walk), lr, step, grad_mul)
                elif b.index in downloads:
                    downloads[b.index].synchronize()
                    self._update(b, self.staging[b.index], lr, step, grad_mul)
                else:
                    self.apply(b, lr, step, grad_mul)
                self.storage.end_update(b)  # ... and is written back
                yield b
            for _ in walk or ():  # the last write-backs
                raise AssertionError("NVMe sub-groups left over after the last bucket")
        finally:
            if walk is not None:
                walk.close()

    def hold(self, events: Dict[int, object]) -> None:
        """Keep bucket ``i``'s masters and moments unchanged until ``events[i]`` is set (an
        ``--async-save`` copying them in the background)."""
        for i in list(self.holds):
            self._wait_hold(i)
        self.holds = dict(events)

    def _wait_hold(self, i: int) -> None:
        event = self.holds.pop(i, None)
        if event is not None:
            event.wait()

    def _update_piece(self, b: Bucket, j: int, views: Dict[str, torch.Tensor], lr: LR, step: int,
                      grad_mul: float) -> None:
        """The update of sub-group ``j`` of bucket ``b`` (on NVMe) in its streaming buffer ``views``,
        and its new weights into the compute-dtype parameters."""
        a, e = self.nvme.pieces[b.index][j]
        grad = self.storage.updated_grads(b)[a:e].to("cpu", torch.float32)
        rate, decoupled_rate = lr
        decay = _within(self.decay[b.index], a, e)
        decoupled = None
        if decoupled_rate is not None:
            decoupled = (_within(self.decoupled[b.index], a, e), decoupled_rate)
        state = {k: views[k] for k in self.optim.state_names}
        self.optim.update(views["master"], grad, state, decay, rate, step, grad_mul=grad_mul,
                          decoupled=decoupled)
        params = self.storage.updated_params(b)[a:e]
        params.copy_(views["master"], non_blocking=params.is_cuda)
        if params.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.nvme.fence(event)  # the buffer is not refilled before the upload is done

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
        """Copy bucket ``b``'s masters into the compute-dtype parameters of the updated range (buckets
        on NVMe publish each sub-group as it is written: :meth:`commit_piece`)."""
        if self.tier[b.index] == "nvme":
            return
        params = self.storage.updated_params(b)
        if params.data_ptr() == self.master[b.index].data_ptr():
            return
        if not self.pinned:
            params.copy_(self.master[b.index])
            return
        params.copy_(self.master[b.index], non_blocking=True)
        self.uploads[b.index] = torch.cuda.Event()
        self.uploads[b.index].record()

    # ---- the state one piece at a time (checkpoints) ------------------------------------
    def pieces(self, b: Bucket) -> List[Tuple[int, int]]:
        """Ranges of the updated range that :meth:`piece_tensors` hands out: the whole of it for a
        bucket in memory, its sub-groups on NVMe."""
        if self.tier[b.index] == "nvme":
            return self.nvme.pieces[b.index]
        return [(0, _length(self.storage.updated_range(b)))]

    def piece_tensors(self, b: Bucket, j: int, keys: Optional[Sequence[str]] = None,
                      read: bool = True) -> Dict[str, torch.Tensor]:
        """``{key: fp32 tensor}`` of piece ``j`` of bucket ``b`` (``key``: ``master`` or a moment): the
        live tensors of a bucket in memory; for NVMe, the sub-group in a reused host buffer (read from
        the disk when ``read``, else undefined, to be filled and given to :meth:`commit_piece`)."""
        keys = list(keys) if keys is not None else self.state_names(with_master=True)
        if self.tier[b.index] == "nvme":
            if read:
                return self.nvme.read_group(b.index, j, keys)
            views = self.nvme.staging(b.index, j)
            return {k: views[k] for k in keys}
        live = {"master": self.master[b.index], **self.state[b.index]}
        return {k: live[k] for k in keys}

    def commit_piece(self, b: Bucket, j: int, tensors: Dict[str, torch.Tensor]) -> None:
        """After filling :meth:`piece_tensors` (``read=False``): write them to the disk and publish
        the master weights of an NVMe sub-group (nothing to do in memory)."""
        if self.tier[b.index] != "nvme":
            return
        self.nvme.write_group(b.index, j, tensors)
        if "master" in tensors:
            a, e = self.nvme.pieces[b.index][j]
            self.storage.updated_params(b)[a:e].copy_(tensors["master"])

    def state_names(self, with_master: bool = False) -> List[str]:
        return (["master"] if with_master else []) + list(self.optim.state_names)

    def zero_state(self) -> None:
        """Zero every moment (a fresh optimizer over loaded weights)."""
        self.hold({})
        with torch.no_grad():
            for st in self.state.values():
                for t in st.values():
                    t.zero_()
        if self.nvme is not None:
            self.nvme.zero_moments()

    def tensors(self) -> List[torch.Tensor]:
        """Every master and moment tensor in memory (for memory accounting; the staging is not
        optimizer state, and the NVMe tier counts apart: :meth:`tier_bytes`)."""
        return list(self.master.values()) + [t for s in self.state.values() for t in s.values()]

    def tier_bytes(self) -> Dict[str, int]:
        """NVMe tier: ``nvme_bytes`` (this rank's swap file) and ``nvme_host_bytes`` (its streaming
        buffers); empty without one."""
        if self.nvme is None:
            return {}
        return {"nvme_bytes": self.nvme.nvme_bytes, "nvme_host_bytes": self.nvme.host_bytes}

    def io_counts(self):
        """The NVMe store's running I/O counters (:class:`~megazero.offload.IOCounts`), or None."""
        return self.nvme.store.stats.snapshot() if self.nvme is not None else None

    def close(self) -> None:
        """Remove the swap file (a clean exit; idempotent)."""
        if self.nvme is not None:
            self.nvme.close()


def decays(p: torch.nn.Parameter, shape: torch.Size) -> bool:
    """Whether weight decay applies to ``p`` (of full ``shape``): ``p.apply_weight_decay`` when set (the
    any-model engine marks each parameter by its optimizer group), else Megatron-LM's rule: matrices
    and embeddings yes, biases and norms no."""
    given = getattr(p, "apply_weight_decay", None)
    return len(shape) > 1 if given is None else bool(given)


def _length(r: Tuple[int, int]) -> int:
    return r[1] - r[0]


def _within(segments, a: int, e: int):
    """``segments`` clipped to ``[a, e)`` and shifted to start at ``a``."""
    return [(max(s, a) - a, min(t, e) - a) for s, t in segments if s < e and t > a]


def _merge(segments):
    out = []
    for a, e in segments:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out
