"""Measure what a configuration really holds, to set beside :func:`megazero.planning.estimate.estimate`.

:func:`measure_rank` runs a few training iterations of a validated config on this rank with the
trainer's own pieces (mesh, model provider, ZeRO optimizer, data, pipeline executor) and returns
per component:

- model state from the optimizer's counters (``optimizer.memory_bytes()``: ``param_bytes``,
  ``grad_bytes``, ``optim_bytes``, ``peak_grad_bytes``) taken after the last step;
- ``activation_bytes``: the peak, over the whole schedule (forwards, backwards and the
  recomputation replays inside backward), of the bytes autograd keeps for backward, measured with
  saved-tensor hooks (:class:`SavedTensorTracker`): each storage counted once, parameters left
  out;
- ``saved_param_bytes``: the peak bytes of parameter storages that autograd keeps beyond what
  the optimizer holds: storages that are neither its persistent buffers nor ZeRO-3 buckets
  gathered at that moment (a gathered bucket that autograd kept alive after ZeRO-3 freed it);
- ``pipeline_input_bytes``: the executor's peak received activations (``PipelineTimer``);
- ``peak_rss_bytes``: the process's peak resident memory over the run (Linux: ``VmHWM``, reset when
  the measurement starts, so a forked rank starts from its resident memory at the fork);
- on CUDA ``max_memory_allocated``.

The hooks wrap the schedule from outside (``torch.autograd.graph.saved_tensors_hooks`` around
``run_schedule``); the trainer and the executor are not modified.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Set

import torch


class _Held:
    """What the pack hook hands to autograd: the tensor, and a finaliser that fires when autograd
    releases it (after the backward that used it)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorTracker:
    """Live bytes of the tensors autograd saves for backward, and their peak.

    Use as a context manager around forward *and* backward (recomputation saves tensors inside
    backward).  A storage is counted once however many saved tensors view it; it leaves the live
    set when autograd has released every saved tensor that uses it.  Tensors that are
    ``nn.Parameter`` s are saved as themselves (their storage follows ``param.data``) and never
    count; views of one (``weight.t()`` in a linear layer) keep the storage they view: when that
    storage is not in ``persistent`` (the optimizer's buffers) they are watched, and at every save
    ``param_peak`` takes the bytes those storages hold *then*, leaving out the ones ``gathered()``
    names (ZeRO-3's buckets in use, counted by the optimizer).  A bucket ZeRO-3 freed holds 0
    bytes; one it dropped while autograd still keeps it counts in full.
    """

    def __init__(self, persistent: Optional[Set[int]] = None, gathered: Optional[Callable[[], set]] = None):
        self.persistent = set(persistent or ())
        self.gathered = gathered or set
        self.live = 0
        self.peak = 0
        self.param_peak = 0
        self._refs: Dict[int, List[int]] = {}  # storage ptr -> [nbytes, holders]
        self._params: Dict[int, list] = {}  # storage identity -> [storage, holders]
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter):  # saved as itself: follows ``param.data`` swaps, pins nothing
            return t
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if isinstance(t._base, torch.nn.Parameter):  # a view (e.g. ``weight.t()``) keeps its storage
            return self._pack_param_view(t, st)
        if nbytes == 0:
            return t
        entry = self._refs.get(ptr)
        if entry is None:
            entry = self._refs[ptr] = [nbytes, 0]
            self._add(nbytes)
        entry[1] += 1
        held = _Held(t)
        weakref.finalize(held, self._release, ptr)
        return held

    def _pack_param_view(self, t: torch.Tensor, st):
        if st.data_ptr() in self.persistent:
            return t
        key = st._cdata
        entry = self._params.setdefault(key, [st, 0])
        entry[1] += 1
        gathered = self.gathered()
        held_now = sum(s.nbytes() for k, (s, _) in self._params.items() if k not in gathered)
        self.param_peak = max(self.param_peak, held_now)
        held = _Held(t)
        weakref.finalize(held, self._release_param, key)
        return held

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _release(self, ptr: int) -> None:
        entry = self._refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[ptr]
            self._add(-entry[0])

    def _release_param(self, key: int) -> None:
        entry = self._params[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._params[key]

    @staticmethod
    def _unpack(obj):
        return obj.tensor if isinstance(obj, _Held) else obj

    def __enter__(self) -> "SavedTensorTracker":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None


def _storage_ptrs(chunks) -> Set[int]:
    return {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()
            if p.untyped_storage().nbytes()}


def measure_rank(cfg, model_provider: Callable, iters: int = 2, device: Optional[torch.device] = None
                 ) -> Dict[str, object]:
    """Train ``iters`` iterations of the validated ``cfg`` on this rank (inside an initialised
    process group, or alone) and return the measured components (module docstring)."""
    from megazero.data import build_data, micro_batches
    from megazero.offload.host_memory import (host_malloc_policy, peak_rss_bytes, reset_peak_rss,
                                              set_host_malloc)
    from megazero.training.lr import lr_from_config
    from megazero.pipeline.executor import PipelineTimer, run_schedule
    from megazero.pipeline.p2p import p2p_tensor_shape
    from megazero.optim.precision import compute_dtype
    from megazero.tensor_parallel.deferred import build_chunks, realize_rest
    from megazero.tensor_parallel.rng import seed_default_generators
    from megazero.training import build_mesh
    from megazero.zero import build_optimizer

    reset_peak_rss()  # a forked rank starts from its parent's high-water mark
    mesh = build_mesh(cfg, device)
    tr, dtype = cfg.training, compute_dtype(cfg)
    set_host_malloc(host_malloc_policy(cfg, mesh.device.type))  # as the trainer does
    seed_default_generators(tr.seed, mesh)
    chunks = build_chunks(model_provider, cfg, mesh, dtype)  # as the trainer builds them
    for c in chunks:
        c.train()
    if mesh.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(mesh.device)
    optimizer = build_optimizer(chunks, mesh, cfg)
    realize_rest(chunks, mesh.device, dtype)
    stage3 = optimizer.stage3
    tracker = SavedTensorTracker(_storage_ptrs(chunks),
                                 stage3.gathered_storages if stage3 is not None else None)
    timer = PipelineTimer()
    data = build_data(cfg)
    for it in range(1, iters + 1):
        optimizer.zero_grad()
        batches = micro_batches(data, it - 1, tr.global_batch_size, tr.micro_batch_size, mesh.coord("dp"),
                                mesh.size("dp"), device=mesh.device)
        with tracker:
            run_schedule(chunks, mesh, batches, schedule=cfg.parallel.pipeline_schedule,
                         num_micro_batches=len(batches), tensor_shape=p2p_tensor_shape(cfg), dtype=dtype,
                         grad_sync=optimizer, loss_scale=float(optimizer.loss_scale), timer=timer,
                         delay_wgrad=cfg.parallel.delay_wgrad_compute)
        optimizer.finish_grad_sync()
        optimizer.step(lr_from_config(cfg, it))
    out: Dict[str, object] = {k: int(v) for k, v in dict(optimizer.memory_bytes()).items()}
    out.update(rank=mesh.rank, pp_rank=mesh.coord("pp"), tp_rank=mesh.coord("tp"), dp_rank=mesh.coord("dp"),
               activation_bytes=tracker.peak, saved_param_bytes=tracker.param_peak,
               pipeline_input_bytes=timer.peak_input_bytes, live_after=tracker.live,
               peak_rss_bytes=peak_rss_bytes())
    if mesh.device.type == "cuda":
        out["max_memory_allocated"] = int(torch.cuda.max_memory_allocated(mesh.device))
    out["nvme_bytes"] = int(out.get("nvme_bytes", 0)) + int(out.pop("nvme_param_bytes", 0))  # both tiers
    optimizer.close()  # the swap files are scratch
    return out
