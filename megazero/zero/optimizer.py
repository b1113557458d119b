"""The ZeRO optimizer over the data-parallel axis (stages 0-3), with mixed precision and clipping.

Storage per rank (``r`` = DP rank, every bucket padded so each rank owns ``numel / dp``):

======  ======================  ==============================  ============================
stage   parameters              gradients                       fp32 master + optimizer state
======  ======================  ==============================  ============================
0       full flat buffer        full flat buffer (all-reduce)   full
1       full flat buffer        full flat buffer (reduce-scat.)  own slice of each bucket
2       full flat buffer        own slice (+ live buckets)      own slice
3       own slice (+ gathered)  own slice (+ live buckets)      own slice
======  ======================  ==============================  ============================

Gradients reach the flat buffers through ``post_accumulate_grad`` hooks (``param.grad`` is
added into the bucket and dropped).  A bucket's reduction is launched asynchronously as soon as
all its parameters' gradients have arrived: stages 0/1 only in the last micro-batch's backward
(``prepare_backward``), stages 2/3 in every backward, keeping only the reduced slice.
``finish_grad_sync`` waits for them and does the once-per-step sums over TP (sequence-parallel
parameters) and the embedding group (tied embeddings); summing the DP-reduced slice over those
groups equals reducing the summed gradient, as the bucket layouts match across them.

Gradient memory in flight is bounded.  Stages 2/3 collect a bucket's gradients in a full-bucket
temporary; stage 1 (and 2/3 on gloo fp32, see :mod:`megazero.zero.comm`) reduce through a
full-bucket receive buffer.  Before a reduction that holds temporaries is launched, every earlier
one is waited for and retired (its slice added into the shard, its temporaries freed), and a
finished one is retired as soon as the next bucket starts; so one reduction runs while the next
bucket fills (the overlap), and the gradient bytes never exceed the persistent buffer plus three
buckets (two on backends with a native reduce-scatter).  ``memory_bytes()["peak_grad_bytes"]``
is the high-water mark, temporaries included.  With ``--no-overlap-grad-reduce`` stages 0/1
reduce after backward; stages 2/3 reduce each bucket when it completes and wait for it.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megazero.clip import clip_coefficient, counts_in_norm, global_norm_and_overflow, local_square_sums
from megazero.precision import build_loss_scaler, compute_dtype
from megazero.zero.buffers import Bucket, find_units, plan_buckets, trainable_params
from megazero.zero.comm import Reduction, all_reduce_mean, reduce_scatter
from megazero.zero.flat_optim import build_flat_optimizer
from megazero.zero.stage3 import Stage3Params

FORMAT = "megazero-zero-v1"


class ZeroOptimizer:
    """ZeRO stage 0-3 optimizer for this rank's model chunks; build it with :func:`build_optimizer`."""

    def __init__(self, chunks: List[torch.nn.Module], mesh, cfg):
        par, pre = cfg.parallel, cfg.precision
        if par.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {par.zero_stage}")
        if par.offload_optimizer and par.zero_stage == 0:
            raise ValueError("--offload-optimizer needs --zero-stage 1, 2 or 3 "
                             "(stage 0 keeps no sharded optimizer state)")
        self.mesh, self.stage, self.cfg = mesh, par.zero_stage, cfg
        self.dp, self.r = mesh.dp_size, mesh.dp_rank
        self.dtype = compute_dtype(pre)
        self.grad_dtype = torch.float32 if pre.grad_reduce_dtype == "fp32" else self.dtype
        self.offload = bool(par.offload_optimizer)
        self.optim_device = torch.device("cpu") if self.offload else torch.device(mesh.device)
        self.overlap = par.overlap_grad_reduce
        self.clip_grad = cfg.optimizer.clip_grad
        self.scaler = build_loss_scaler(pre)
        self.optim = build_flat_optimizer(cfg.optimizer)
        self.chunks = list(chunks)
        self.step_count = 0
        self.skipped_steps = 0
        self._last = [True] * len(self.chunks)
        self._pending: Deque[Tuple[Reduction, int]] = deque()  # launched, with caller-owned input bytes
        self._ready: List[Bucket] = []  # complete buckets waiting to be launched (no overlap)
        self._synced = True

        seen: Dict[int, bool] = {}
        groups, units = [], []
        for c, chunk in enumerate(self.chunks):
            if self.stage == 3:
                for m in find_units(chunk):
                    groups.append((c, len(units), trainable_params(m, seen)))
                    units.append((m, c))
            else:
                groups.append((c, None, trainable_params(chunk, seen)))
        self.buckets = plan_buckets(groups, self.dp, par.ddp_bucket_size)
        self.numel = sum(p.numel() for b in self.buckets for p in b.params)
        self._where = {id(p): (b, s, i) for b in self.buckets for i, (p, s) in enumerate(zip(b.params, b.starts))}
        self._build_storage()
        grad_buf = self.grad_buf if self.stage < 2 else self.grad_shard_buf
        self._grad_live = grad_buf.untyped_storage().nbytes()  # grad bytes held now, temporaries included
        self.peak_grad_bytes = self._grad_live  # their high-water mark since construction
        self.stage3 = None
        if self.stage == 3:
            self.stage3 = Stage3Params(units, self.buckets, self._param_shard, mesh, self.dtype)
            self.stage3.free_all()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for b in self.buckets for p in b.params]

    # ---- storage ------------------------------------------------------------------------
    def _owned(self, b: Bucket):
        """Bucket-local range the optimizer updates on this rank (all of it at stage 0)."""
        return (0, b.numel) if self.stage == 0 else b.shard_range(self.r)

    def _build_storage(self) -> None:
        dev, total = self.mesh.device, sum(b.numel for b in self.buckets)
        shard_total, off = 0, 0
        for b in self.buckets:
            b.shard_offset = shard_total
            shard_total += b.shard_numel
        if self.stage < 3:
            self.param_buf = torch.zeros(total, dtype=self.dtype, device=dev)
        else:
            self.param_shard_buf = torch.zeros(shard_total, dtype=self.dtype, device=dev)
        if self.stage < 2:
            self.grad_buf = torch.zeros(total, dtype=self.grad_dtype, device=dev)
        else:
            self.grad_shard_buf = torch.zeros(shard_total, dtype=self.grad_dtype, device=dev)
        self.master, self.state, self.decay, self.norm_pieces = {}, {}, {}, {}
        for b in self.buckets:
            full = torch.zeros(b.numel, dtype=torch.float32, device=dev)
            for p, s in zip(b.params, b.starts):
                full[s:s + p.numel()].copy_(p.detach().reshape(-1))
            lo, hi = self._owned(b)
            if self.stage < 3:
                self.param_buf[b.offset:b.offset + b.numel].copy_(full)
                for p, s in zip(b.params, b.starts):
                    p.data = self.param_buf[b.offset + s:b.offset + s + p.numel()].view(p.shape)
            else:
                self._param_shard(b).copy_(full[lo:hi])
            pview = self._param_view(b)
            if self.offload or self.dtype != torch.float32:
                self.master[b.index] = full[lo:hi].to(self.optim_device, copy=True)
            else:
                self.master[b.index] = pview  # fp32 params are their own master weights
            self.state[b.index] = self.optim.init_state(self.master[b.index])
            self.decay[b.index] = _merge([(a - lo, e - lo) for p, a, e in b.segments(lo, hi) if p.dim() > 1])
            nlo, nhi = b.shard_range(self.r)
            counted = []  # adjacent segments with the same flag merged: one norm piece per run
            for p, a, e in b.segments(nlo, nhi):
                flag = counts_in_norm(p, self.mesh.tp_rank)
                if counted and counted[-1][1] == a and counted[-1][2] == flag:
                    counted[-1] = (counted[-1][0], e, flag)
                else:
                    counted.append((a, e, flag))
            self.norm_pieces[b.index] = counted
            del full

    def _param_shard(self, b: Bucket) -> torch.Tensor:
        return self.param_shard_buf[b.shard_offset:b.shard_offset + b.shard_numel]

    def _param_view(self, b: Bucket) -> torch.Tensor:
        """The compute-dtype parameters this rank updates (owned range)."""
        if self.stage == 3:
            return self._param_shard(b)
        lo, hi = self._owned(b)
        return self.param_buf[b.offset + lo:b.offset + hi]

    def _grad_view(self, b: Bucket) -> torch.Tensor:
        """The reduced gradients of the owned range (valid after ``finish_grad_sync``)."""
        if self.stage >= 2:
            return self.grad_shard_buf[b.shard_offset:b.shard_offset + b.shard_numel]
        lo, hi = self._owned(b)
        return self.grad_buf[b.offset + lo:b.offset + hi]

    def _grad_local(self, b: Bucket, a: int, e: int) -> torch.Tensor:
        """Reduced gradient of bucket-local ``[a, e)`` inside this rank's DP slice."""
        if self.stage >= 2:
            base = b.shard_offset - self.r * b.shard_numel
            return self.grad_shard_buf[base + a:base + e]
        return self.grad_buf[b.offset + a:b.offset + e]

    # ---- backward: hooks and reductions -------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            return
        b, s, i = self._where[id(p)]
        grad = p.grad.reshape(-1)
        if self.stage >= 2:
            if b.grad_tmp is None:  # a fresh bucket: each gradient is copied in, not added to zeros
                self._retire_finished()
                b.grad_tmp = torch.empty(b.numel, dtype=self.grad_dtype, device=self.mesh.device)
                self._hold(b.grad_tmp.nbytes)
                b.grad_tmp[b.starts[-1] + b.shapes[-1].numel():].zero_()  # padding
                b.written = [False] * len(b.params)
            dst = b.grad_tmp[s:s + grad.numel()]
            if b.written[i]:
                dst.add_(grad)
            else:
                dst.copy_(grad)
                b.written[i] = True
        else:
            self.grad_buf[b.offset + s:b.offset + s + grad.numel()].add_(grad)
        p.grad = None
        self._synced = False
        b.arrived += 1
        if b.arrived == len(b.params):
            self._complete(b)

    def _complete(self, b: Bucket) -> None:
        b.arrived = 0
        if self.stage3 is not None:
            self.stage3.bucket_done(b)
        if self.stage <= 1 and not self._last[b.chunk]:
            return
        if self.overlap:
            self._launch(b)
        elif self.stage >= 2:  # no overlap, but no pile of full buckets either: reduce it now
            self._launch(b)
            self._retire()
        else:
            self._ready.append(b)

    # ---- reductions in flight and the gradient bytes they hold ---------------------------
    def _hold(self, nbytes: int, transient: int = 0) -> None:
        """``nbytes`` more gradient bytes are held from now on (negative: freed); ``transient``
        more only for a moment.  Updates the high-water mark."""
        self._grad_live += nbytes
        self.peak_grad_bytes = max(self.peak_grad_bytes, self._grad_live + transient)

    def _retire_one(self) -> None:
        """Wait for the oldest reduction, add its result in, free its temporaries."""
        red, owned = self._pending.popleft()
        self._hold(0, red.finish_bytes - owned)  # the input is dropped before post-processing
        red.wait()
        self._hold(-owned - red.nbytes)

    def _retire(self, keep: int = 0) -> None:
        """Retire reductions, oldest first, until at most ``keep`` are in flight."""
        while len(self._pending) > keep:
            self._retire_one()

    def _retire_finished(self) -> None:
        """Retire the reductions that are already over (never blocks)."""
        while self._pending and self._pending[0][0].done():
            self._retire_one()

    def _start(self, red: Reduction, owned: int) -> None:
        """Track a launched reduction holding ``owned`` bytes of the caller's temporaries."""
        self._pending.append((red, owned))
        self._hold(red.nbytes)

    def _launch(self, b: Bucket) -> None:
        dp, group = self.dp, self.mesh.dp_group
        if self.stage <= 1:
            if b.reduced:
                return
            b.reduced = True
            full = self.grad_buf[b.offset:b.offset + b.numel]
            if dp > 1 and self.stage == 0:  # in place: nothing to bound
                self._start(all_reduce_mean(full, group, dp), 0)
            elif dp > 1:
                self._retire()  # one receive buffer at a time
                self._start(reduce_scatter(self._grad_view(b), full, group, 1.0 / dp), 0)
            return
        tmp, b.grad_tmp = b.grad_tmp, None
        if tmp is None:
            return
        for s, shape, written in zip(b.starts, b.shapes, b.written):
            if not written:  # no gradient this backward (unused parameter)
                tmp[s:s + shape.numel()].zero_()
        shard = self._grad_view(b)
        if dp == 1:
            shard.add_(tmp)
            self._hold(-tmp.nbytes)
            return
        self._retire()  # one reduction in flight while the next bucket fills
        self._start(reduce_scatter(shard, tmp, group, 1.0 / dp, accumulate=True), tmp.nbytes)

    def _drain(self) -> None:
        for b in self._ready:
            self._launch(b)
        self._ready = []
        self._retire()

    def _flush_incomplete(self) -> None:
        """Buckets left incomplete by the last backward (unused parameters) are reduced as they are."""
        for b in self.buckets:
            if b.arrived:
                b.arrived = 0
                if self.stage3 is not None:
                    self.stage3.free(self.stage3.units[b.unit])
                if self.stage >= 2 or self._last[b.chunk]:
                    self._launch(b)

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        """Called before each backward: stages 0/1 reduce only in the last micro-batch's backward."""
        self._flush_incomplete()
        if self.stage >= 2:
            self._drain()  # the previous backward's reductions: frees their bucket buffers
        self._last[chunk_index] = bool(is_last_microbatch)
        self._synced = False

    def finish_grad_sync(self) -> None:
        """Wait for every reduction and do the once-per-step TP / embedding-group sums."""
        self._flush_incomplete()
        if self.stage <= 1:
            for b in self.buckets:
                self._launch(b)  # buckets never completed in a last micro-batch (no-op if reduced)
        self._drain()
        mesh = self.mesh
        if mesh.tp_size > 1:
            for b in self.buckets:
                if b.kind == "sp":
                    dist.all_reduce(self._grad_view(b), group=mesh.tp_group)
        if mesh.pp_size > 1 and mesh.in_embedding_group:
            for b in self.buckets:
                if b.kind == "emb":
                    dist.all_reduce(self._grad_view(b), group=mesh.embedding_group)
        if self.stage3 is not None:
            self.stage3.free_all()
        self._synced = True

    # ---- the step -----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (multiply the loss by it before backward; 1.0 without fp16)."""
        return self.scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients for the next step."""
        self._retire()  # nothing may still write into the buffers zeroed below
        for b in self.buckets:
            if b.grad_tmp is not None:
                self._hold(-b.grad_tmp.nbytes)
            b.arrived, b.reduced, b.grad_tmp = 0, False, None
            for p in b.params:
                p.grad = None
        if self.stage < 2:
            self.grad_buf.zero_()
        else:
            self.grad_shard_buf.zero_()
        self._ready = []

    def step(self, lr: float) -> Dict[str, object]:
        """Unscale, check overflow (world-wide), clip and update.  Returns ``skipped``,
        ``grad_norm`` (before clipping, unscaled), ``loss_scale`` (in force after the step)."""
        if not self._synced:
            self.finish_grad_sync()
        scale = self.scaler.scale
        pieces = [(self._grad_local(b, a, e), counted)
                  for b in self.buckets for a, e, counted in self.norm_pieces[b.index]]
        norm, found_inf = global_norm_and_overflow(local_square_sums(pieces), self.mesh)
        norm = norm / scale
        if found_inf:
            self.skipped_steps += 1
            self.scaler.update(True)
            for b in self.buckets:
                b.reduced = False
            return {"skipped": True, "grad_norm": norm, "loss_scale": self.scaler.scale}
        factor = clip_coefficient(norm, self.clip_grad) / scale
        self.step_count += 1
        gathers = []
        for b in self.buckets:
            grad = self._grad_view(b).to(self.optim_device, torch.float32)  # fp32 grads: no copy
            master = self.master[b.index]
            self.optim.update(master, grad, self.state[b.index], self.decay[b.index], lr, self.step_count,
                              grad_mul=factor)
            pview = self._param_view(b)
            if pview.data_ptr() != master.data_ptr():
                pview.copy_(master)
            if self.stage in (1, 2) and self.dp > 1:
                full = self.param_buf[b.offset:b.offset + b.numel]
                gathers.append(dist.all_gather_single(full, pview, group=self.mesh.dp_group, async_op=True))
            b.reduced = False
        for h in gathers:
            h.wait()
        self.scaler.update(False)
        return {"skipped": False, "grad_norm": norm, "loss_scale": self.scaler.scale}

    # ---- memory, parameters, state ------------------------------------------------------
    def memory_bytes(self) -> Dict[str, int]:
        """Model-state bytes this rank holds now (each storage counted once), and
        ``peak_grad_bytes``: the most gradient bytes held at any moment so far, the temporaries of
        backward (live buckets, reductions in flight) included."""
        seen: Dict[int, bool] = {}

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                st = t.untyped_storage()
                if st.data_ptr() not in seen and st.nbytes():
                    seen[st.data_ptr()] = True
                    total += st.nbytes()
            return total

        params = [self.param_buf] if self.stage < 3 else [self.param_shard_buf] + self.stage3.live_buffers()
        grads = [self.grad_buf] if self.stage < 2 else [self.grad_shard_buf] + [
            b.grad_tmp for b in self.buckets if b.grad_tmp is not None]
        optim = list(self.master.values()) + [t for s in self.state.values() for t in s.values()]
        return {"param_bytes": nbytes(params), "grad_bytes": nbytes(grads), "optim_bytes": nbytes(optim),
                "peak_grad_bytes": self.peak_grad_bytes}

    def num_parameters(self) -> int:
        """Elements of this rank's trainable (unsharded) parameters."""
        return self.numel

    @contextlib.contextmanager
    def gathered_params(self):
        """Full parameters inside the block under ZeRO-3 (collective over DP); a no-op otherwise."""
        if self.stage3 is None:
            yield
            return
        self.stage3.gather_all()
        try:
            yield
        finally:
            self.stage3.free_all()

    def _full_bucket(self, b: Bucket, shard: torch.Tensor, dst: Optional[int] = None) -> Optional[torch.Tensor]:
        """A whole bucket's fp32 values from each rank's owned slice (collective over DP): on every
        DP rank (``dst`` None, an all-gather) or on DP rank ``dst`` only (a gather; None elsewhere)."""
        receives = dst is None or dst == self.r
        shard = shard.detach().to(self.mesh.device, torch.float32)
        if self.stage == 0 or self.dp == 1:  # every rank holds the whole bucket already
            return shard.clone() if receives else None
        full = torch.empty(b.numel, dtype=torch.float32, device=self.mesh.device) if receives else None
        if dst is None:
            dist.all_gather_single(full, shard.contiguous(), group=self.mesh.dp_group)
        else:
            dist.gather(shard.contiguous(), list(full.chunk(self.dp)) if receives else None,
                        group=self.mesh.dp_group, group_dst=dst)
        return full

    def param_states(self, dst: Optional[int] = None) -> Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]:
        """Layout-free optimizer state: for every parameter its full fp32 ``master`` weight and
        optimizer moments (CPU tensors of the parameter's shape), plus ``step``.  Collective over DP;
        checkpoints use it to reshard across ZeRO stages and DP sizes.

        ``dst``: the DP rank that receives the state (the others return ``{}`` and hold no copy: each
        bucket is gathered to it alone, one at a time); None: every DP rank receives it."""
        out: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
        for b in self.buckets:
            fulls = {"master": self._full_bucket(b, self.master[b.index], dst)}
            fulls.update({k: self._full_bucket(b, v, dst) for k, v in self.state[b.index].items()})
            if fulls["master"] is None:
                continue
            for p, s, shape in zip(b.params, b.starts, b.shapes):
                out[p] = {k: v[s:s + shape.numel()].view(shape).to("cpu", copy=True) for k, v in fulls.items()}
                out[p]["step"] = torch.tensor(self.step_count)
            del fulls
        return out

    def param_shapes(self) -> Dict[torch.nn.Parameter, torch.Size]:
        """Every trainable parameter's full (unsharded) shape, from the bucket metadata: no gather,
        even under ZeRO-3 where ``param.data`` is freed between uses."""
        return {p: shape for b in self.buckets for p, shape in zip(b.params, b.shapes)}

    def load_param_states(self, states: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`param_states` (any layout): keep this rank's slice; parameters follow."""
        for b in self.buckets:
            lo, hi = self._owned(b)
            for key in ("master",) + tuple(self.state[b.index]):
                full = torch.zeros(b.numel, dtype=torch.float32)
                for p, s, shape in zip(b.params, b.starts, b.shapes):
                    if p not in states or key not in states[p]:
                        raise ValueError(f"optimizer state for a parameter of shape {tuple(shape)} "
                                         f"lacks {key!r}")
                    full[s:s + shape.numel()] = states[p][key].reshape(-1).float()
                dst = self.master[b.index] if key == "master" else self.state[b.index][key]
                dst.copy_(full[lo:hi])
            self._publish_master(b)
        steps = {int(st["step"]) for st in states.values() if "step" in st}
        if steps:
            self.step_count = steps.pop()

    def _publish_master(self, b) -> None:
        """After loading bucket ``b``'s master slice: write it into the (compute-dtype) parameters
        and, under stages 1/2, all-gather the slices into every rank's full parameter buffer."""
        pview = self._param_view(b)
        if pview.data_ptr() != self.master[b.index].data_ptr():
            pview.copy_(self.master[b.index])
        if self.stage in (1, 2) and self.dp > 1:
            full = self.param_buf[b.offset:b.offset + b.numel]
            dist.all_gather_single(full, pview, group=self.mesh.dp_group)

    def _layout(self):
        return [b.signature() for b in self.buckets]

    def state_dict(self) -> Dict[str, object]:
        """This rank's optimizer shard (master weights, moments, step, loss scaler)."""
        return {"format": FORMAT, "zero_stage": self.stage, "dp_size": self.dp, "dp_rank": self.r,
                "optimizer": self.cfg.optimizer.optimizer, "layout": self._layout(),
                "step": self.step_count, "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict(),
                "master": [self.master[b.index].detach().cpu().clone() for b in self.buckets],
                "state": [{k: v.cpu().clone() for k, v in self.state[b.index].items()} for b in self.buckets]}

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        """Load a shard saved by :meth:`state_dict` under the same stage, DP size and layout."""
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            raise ValueError("not a megazero ZeRO optimizer state dict (missing format tag)")
        mine = (self.stage, self.dp, self.r, self.cfg.optimizer.optimizer)
        saved = (sd["zero_stage"], sd["dp_size"], sd["dp_rank"], sd["optimizer"])
        if mine != saved or sd["layout"] != self._layout():
            what = ("the bucket layout (model shapes or --ddp-bucket-size) differs"
                    if mine == saved else f"saved with (zero stage, DP size, DP rank, optimizer) = {saved}")
            raise ValueError(
                f"cannot load this optimizer state: {what}, but this run has {mine}. Load a checkpoint "
                "written under the same --zero-stage, data-parallel size and model, or reshard it through "
                "the per-parameter state (param_states / load_param_states)")
        for b, master, state in zip(self.buckets, sd["master"], sd["state"]):
            self.master[b.index].copy_(master)
            for k, v in state.items():
                self.state[b.index][k].copy_(v)
            self._publish_master(b)
        self.step_count, self.skipped_steps = sd["step"], sd["skipped_steps"]
        self.scaler.load_state_dict(sd["scaler"])


def _merge(segments):
    out = []
    for a, e in segments:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out


def build_optimizer(chunks, mesh, cfg) -> ZeroOptimizer:
    """The single entry point: a ZeRO optimizer (stage ``cfg.parallel.zero_stage``) for this rank's
    model chunks.  Puts the parameters into flat compute-dtype buffers (as views) and registers the
    gradient hooks; under ZeRO-3 the parameters are sharded from here on."""
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    return ZeroOptimizer(list(chunks), mesh, cfg)
