"""The ZeRO optimizer over the data-parallel axis (stages 0-3), with mixed precision and clipping.

It composes four pieces, each in its own module:

- :mod:`megazero.zero.storage`: the flat parameter and gradient buffers (or this rank's shards);
- :mod:`megazero.zero.reducers`: gradient synchronisation during backward (the
  :class:`~megazero.zero.reducers.GradSync` protocol the pipeline executor calls), an all-reduce
  or reduce-scatter at the last micro-batch for stages 0/1, a reduce-scatter every micro-batch
  for stages 2/3;
- :mod:`megazero.zero.update`: fp32 master weights, optimizer moments and the update on this
  rank's slice, in host memory with ``--offload-optimizer``;
- :mod:`megazero.zero.stage3`: under stage 3, gathering each unit's parameters just before use.

Checkpoints read and write the update's tensors in place (:mod:`megazero.checkpoint`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megazero.optim.clip import clip_coefficient, global_norm_and_overflow, local_square_sums
from megazero.offload.host_memory import release_free
from megazero.optim.precision import build_loss_scaler, compute_dtype
from megazero.tensor_parallel.deferred import initial_value, is_deferred, realize
from megazero.zero.buckets import (REDUCTION_GROUPS, Bucket, bucket_groups, default_blocks, plan_buckets,
                                   trainable_params)
from megazero.zero.param_gather import OverlappedParamGather
from megazero.zero.reducers import EveryMicroBatchReducer, LastMicroBatchReducer
from megazero.zero.stage3 import Prefetch, Stage3Params
from megazero.zero.stages import check_stage, overlaps_param_gather, shards_gradients, shards_parameters
from megazero.zero.storage import FlatStorage
from megazero.zero.update import ShardedUpdate
from megazero.offload.settings import check_offload, optimizer_device, param_device


class ZeroOptimizer:
    """ZeRO stage 0-3 optimizer for this rank's model chunks; build it with :func:`build_optimizer`."""

    def __init__(self, chunks: List[torch.nn.Module], mesh, cfg, blocks: Callable = default_blocks,
                 prefetch: Optional[Prefetch] = None, values: Optional[Callable] = None):
        par, pre = cfg.parallel, cfg.precision
        self.blocks = blocks
        check_stage(par.zero_stage)
        check_offload(par)
        self.mesh, self.stage, self.cfg = mesh, par.zero_stage, cfg
        self.dtype = compute_dtype(pre)
        self.grad_dtype = torch.float32 if pre.grad_reduce_dtype == "fp32" else self.dtype
        self.clip_grad = cfg.optimizer.clip_grad
        self.scaler = build_loss_scaler(pre)
        self.chunks = list(chunks)
        # stages 1/2 on several DP ranks: the parameter all-gather runs during the next forward
        self.overlap_param_gather = overlaps_param_gather(self.stage, mesh.size("dp", "cp"),
                                                          par.overlap_param_gather)
        self.step_count = 0
        self.skipped_steps = 0
        units, groups = self._param_groups()
        self.buckets = plan_buckets(groups, {k: mesh.size(*g) for k, g in REDUCTION_GROUPS.items()},
                                    par.ddp_bucket_size)
        self.numel = sum(p.numel() for b in self.buckets for p in b.params)
        self.param_swap = None
        if shards_parameters(self.stage) and param_device(par) == "nvme":
            from megazero.zero.param_swap import ParamSwap
            self.param_swap = ParamSwap(self.buckets, self.dtype, par, mesh)
        self.storage = FlatStorage(self.buckets, self.stage, mesh, self.dtype, self.grad_dtype,
                                   self.param_swap)
        self.update = ShardedUpdate(self.storage, cfg.optimizer, self.dtype, False, mesh.coord("tp"),
                                    tiers=assign_tiers(self.buckets, self.storage, par), par=par)
        for b in self.buckets:
            full = _bucket_values(b, mesh.device, self.dtype) if values is None else values(b, mesh.device)
            self.storage.adopt(b, full)
            self.update.add_bucket(b, full)
            del full
        self._settle_param_writes()
        self.param_gather = None
        if self.overlap_param_gather:
            self.param_gather = OverlappedParamGather(self.chunks, self.buckets, blocks)
        self.stage3 = None
        if shards_parameters(self.stage):
            self.stage3 = Stage3Params(units, self.storage, mesh, self.dtype, prefetch or Prefetch())
        release_free()  # what setting up the buckets freed, before the gradient buffer comes
        self.storage.allocate_grads()  # (deferred with parameters on NVMe: the model's tensors are gone)
        on_complete = self.stage3.bucket_done if self.stage3 is not None else (lambda b: None)
        in_flight = par.max_reductions_in_flight
        if shards_gradients(self.stage):
            self.reducer = EveryMicroBatchReducer(self.storage, par.overlap_grad_reduce, on_complete,
                                                  in_flight)
        else:
            self.reducer = LastMicroBatchReducer(self.storage, par.overlap_grad_reduce, on_complete,
                                                 len(self.chunks), in_flight)

    def _param_groups(self):
        """``(units, groups)``: ZeRO-3 gather units ``(module, chunk)`` and the groups to cut into
        buckets (:func:`megazero.zero.buckets.bucket_groups`, shared with the memory estimator)."""
        seen: Dict[int, bool] = {}
        params = [trainable_params(chunk, seen) for chunk in self.chunks]
        blocks = [self.blocks(chunk) for chunk in self.chunks]
        block_of = {id(p): i for bs in blocks for i, (_, ps) in enumerate(bs) for p in ps}
        groups = bucket_groups(params, lambda p: block_of.get(id(p)), self.stage, self.overlap_param_gather)
        units = [(self.chunks[g.chunk] if g.block is None else blocks[g.chunk][g.block][0], g.chunk)
                 for g in groups if g.unit is not None]
        return units, groups

    # ---- around backward (the GradSync protocol) ----------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (multiply the loss by it before backward; 1.0 without fp16)."""
        return self.scaler.scale

    def prepare_backward(self, chunk_index: int, is_last_microbatch: bool) -> None:
        """Called before each backward: stages 0/1 reduce only in the last micro-batch's backward."""
        self.reducer.prepare_backward(chunk_index, is_last_microbatch)
        if self.stage3 is not None:
            self.stage3.free_all()  # nothing stays gathered from one backward to the next

    def defer_weight_grads(self) -> None:
        """``--delay-wgrad-compute``: queue linear layers' weight gradients until
        :meth:`compute_deferred_weight_grads` (the pipeline executor calls both)."""
        self.reducer.defer_weight_grads()

    def compute_deferred_weight_grads(self) -> None:
        self.reducer.compute_deferred_weight_grads()

    def finish_grad_sync(self) -> None:
        """Wait for every reduction and do the once-per-step TP / embedding-group sums."""
        self.reducer.compute_deferred_weight_grads()  # none are left queued by the executor
        self.reducer.finish_grad_sync()
        if self.stage3 is not None:
            self.stage3.free_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the accumulated gradients for the next step."""
        self.reducer.zero_grad()

    # ---- the step -----------------------------------------------------------------------
    def step(self, lr: float, decoupled_lr: Optional[float] = None, skip: bool = False) -> Dict[str, object]:
        """Unscale, check overflow (world-wide), clip and update with rate ``lr`` (``decoupled_lr``
        for the parameters marked ``is_embedding_or_output_parameter``, when given).  Returns
        ``skipped``, ``grad_norm`` (before clipping, unscaled), ``loss_scale`` (in force after the step).
        ``skip`` (the same on every rank: a loss spike, ``--loss-spike-action skip``): the update is
        not applied, as after an overflow, but the loss scaler is left alone; ``spike`` is then True."""
        self.finish_param_sync()  # the previous step's gathers (normally done by the forward)
        if not self.reducer.synced:
            self.finish_grad_sync()
        scale = self.scaler.scale
        squares = local_square_sums(self.update.grad_norm_pieces())
        norm, found_inf = global_norm_and_overflow(squares, self.mesh)
        norm = norm / scale
        self.reducer.end_step()
        if skip:
            self.skipped_steps += 1
            return {"skipped": True, "spike": True, "grad_norm": norm, "loss_scale": self.scaler.scale}
        if found_inf:
            self.skipped_steps += 1
            self.scaler.update(True)
            return {"skipped": True, "grad_norm": norm, "loss_scale": self.scaler.scale}
        factor = clip_coefficient(norm, self.clip_grad) / scale
        self.step_count += 1
        self._update_and_gather((lr, decoupled_lr), factor)
        self.scaler.update(False)
        return {"skipped": False, "grad_norm": norm, "loss_scale": self.scaler.scale}

    def _update_and_gather(self, lr: Tuple[float, Optional[float]], factor: float) -> None:
        """Update every bucket and start all-gathering its parameters (stages 1/2), in the order the
        next forward needs them; with overlap the forward waits for each, otherwise here."""
        overlap = self.param_gather
        order = [self.buckets[i] for i in overlap.order] if overlap is not None else self.buckets
        gathers = []
        for b in self.update.apply_all(order, lr, self.step_count, factor):
            work = self.storage.all_gather_params(b, async_op=True)
            if overlap is not None:
                overlap.launched(b, work)
            elif work is not None:
                gathers.append(work)
        for work in gathers:
            work.wait()
        self._settle_param_writes()

    def _settle_param_writes(self) -> None:
        """Parameters on NVMe: wait for the last write-backs, so that their host copies are not held
        through the next forward and backward."""
        if self.param_swap is not None:
            self.param_swap.settle()

    def finish_param_sync(self) -> None:
        """Stages 1/2 with overlapped gathers: wait for the parameter all-gathers still in flight
        (call before reading parameters outside a forward; a no-op otherwise)."""
        if self.param_gather is not None:
            self.param_gather.finish()

    def publish_params(self, b: Bucket) -> None:
        """After bucket ``b``'s masters changed outside a step (loading): the compute-dtype
        parameters follow on every rank that holds them."""
        self.finish_param_sync()
        self.update.publish(b)
        self.storage.all_gather_params(b)

    # ---- memory -------------------------------------------------------------------------
    def memory_bytes(self) -> Dict[str, int]:
        """Model-state bytes this rank holds now (each storage counted once);
        ``peak_grad_bytes``: the most gradient bytes held at any moment so far, the temporaries of
        backward (partial buckets, reductions in flight) included; ``peak_param_bytes``: the
        parameter shards plus the most ZeRO-3 gathered units held at once (the parameter buffer
        below stage 3); ``host_staging_bytes`` (offload from a GPU only): pinned gradient copies."""
        seen: Dict[int, bool] = {}

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                st = t.untyped_storage()
                if st.data_ptr() not in seen and st.nbytes():
                    seen[st.data_ptr()] = True
                    total += st.nbytes()
            return total

        params = [self.storage.params] + (self.stage3.live_buffers() if self.stage3 is not None else [])
        grads = [self.storage.grads] + self.reducer.partial_buffers()
        shard = self.storage.params.untyped_storage().nbytes()
        if self.param_swap is not None:  # shards on NVMe: those in memory now, and at most so far
            params.extend(self.param_swap.homes[i] for i in self.param_swap.resident)
            shard = self.param_swap.peak_resident_bytes
        gathered = self.stage3.peak_gathered_bytes if self.stage3 is not None else 0
        out = {"param_bytes": nbytes(params), "grad_bytes": nbytes(grads),
               "optim_bytes": nbytes(self.update.tensors()), "peak_grad_bytes": self.reducer.grad_bytes.peak,
               "peak_param_bytes": shard + gathered}
        if self.update.staging:
            out["host_staging_bytes"] = nbytes(self.update.staging.values())
        out.update(self.update.tier_bytes())
        if self.param_swap is not None:
            out["nvme_param_bytes"] = self.param_swap.store.file_bytes
        return out

    def io_counts(self):
        """Running I/O counters of the NVMe tiers (:class:`~megazero.offload.IOCounts`; optimizer
        state and parameters together), None without one."""
        counts = [c for c in (self.update.io_counts(),
                              self.param_swap.store.stats.snapshot() if self.param_swap else None) if c]
        return sum(counts[1:], counts[0]) if counts else None

    def close(self) -> None:
        """Release what outlives a step: the NVMe swap files are removed (call at a clean exit)."""
        self.update.close()
        if self.param_swap is not None:
            self.param_swap.close()

    def num_parameters(self) -> int:
        """Elements of this rank's trainable (unsharded) parameters."""
        return self.numel

    @contextlib.contextmanager
    def gathered_params(self):
        """Full parameters inside the block: under ZeRO-3 gathered (collective over DP), under stages
        1/2 with the last step's all-gathers complete."""
        if self.stage3 is None:
            self.finish_param_sync()
            yield
            return
        self.stage3.gather_all()
        try:
            yield
        finally:
            self.stage3.free_all()

    # ---- checkpoint state (megazero.checkpoint reads and writes the update's tensors) ----
    @property
    def state(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """Optimizer moments per bucket index (this rank's slice)."""
        return self.update.state

    def param_shapes(self) -> Dict[torch.nn.Parameter, torch.Size]:
        """Every trainable parameter's full shape, from the bucket metadata (no gather under ZeRO-3)."""
        return {p: shape for b in self.buckets for p, shape in zip(b.params, b.shapes)}


def assign_tiers(buckets: List[Bucket], storage: FlatStorage, par) -> Dict[int, str]:
    """Bucket index -> where its optimizer state lives: ``device``, ``cpu`` or ``nvme``.  With
    ``--optimizer-offload-fraction f`` (Megatron-LM's meaning: the share offloaded), buckets in order
    go to the offload device while the elements offloaded stay within ``f`` of the total."""
    dev = optimizer_device(par)
    if dev == "none" or par.zero_stage == 0:
        return {b.index: "device" for b in buckets}
    sizes = {b.index: storage.updated_range(b)[1] - storage.updated_range(b)[0] for b in buckets}
    limit, taken, out = float(par.optimizer_offload_fraction) * sum(sizes.values()), 0, {}
    for b in buckets:
        if taken + sizes[b.index] <= limit:
            out[b.index], taken = dev, taken + sizes[b.index]
        else:
            out[b.index] = "device"
    return out


def _bucket_values(b: Bucket, device, dtype: torch.dtype) -> torch.Tensor:
    """Bucket ``b``'s parameters as one padded fp32 tensor; a deferred parameter's value is computed
    here (:mod:`megazero.tensor_parallel.deferred`) and the parameter becomes an empty ``dtype`` one
    (the storage points it at the flat buffers next)."""
    full = torch.zeros(b.numel, dtype=torch.float32, device=device)
    for p, s, shape in zip(b.params, b.starts, b.shapes):
        full[s:s + shape.numel()].copy_(initial_value(p).reshape(-1))
        if is_deferred(p):
            realize(p, torch.empty(0, dtype=dtype, device=device))
    return full


def build_optimizer(chunks, mesh, cfg, blocks: Callable = default_blocks, prefetch: Optional[Prefetch] = None,
                    values: Optional[Callable] = None) -> ZeroOptimizer:
    """The single entry point: a ZeRO optimizer (stage ``cfg.parallel.zero_stage``) for this rank's
    model chunks.  Puts the parameters into flat compute-dtype buffers (as views) and registers the
    gradient hooks; under ZeRO-3 the parameters are sharded from here on.

    For models other than megazero's own (the any-model engine, :mod:`megazero.engine`):
    ``blocks(chunk)`` gives the ZeRO-3 gather units as ``(module, parameters)`` (default
    :func:`~megazero.zero.buckets.default_blocks`: the layers of the chunk's largest ``ModuleList``);
    ``prefetch`` how far ZeRO-3 gathers ahead (default one unit); ``values(bucket, device)`` the
    bucket's full fp32 values as one padded tensor, when the parameters do not hold them (a model
    built partitioned)."""
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    return ZeroOptimizer(list(chunks), mesh, cfg, blocks, prefetch, values)
