"""ZeRO-3 parameter sharding: gather a unit's parameters just before they are used, free after.

A *unit* is one transformer layer (a block of the chunk's largest ``nn.ModuleList``) or the
rest of a chunk (embedding, final norm, output head); for other models, whatever blocks
:func:`megazero.zero.build_optimizer` is given (:mod:`megazero.engine.units`).  Between uses each
rank holds only its shard of every bucket; ``param.data`` is an empty tensor.

- forward pre-hook: gather the unit (waiting for a prefetch if one is in flight) and start
  gathering the unit whose forward comes next;
- forward post-hook: free the unit and hook its outputs (those that are not its inputs passed
  through) so it is gathered again just before its backward, prefetching the unit whose backward
  comes next (after the root, the last block, then the blocks in reverse);
- the order is the blocks' registration order until a chunk's first forward has run, then the
  order that forward used them in (:class:`Prefetch` sets how far ahead to gather: one unit by
  default, or units up to a number of elements, never past a limit on the elements gathered);
- inside backward a forward is a recomputation replay
  (:mod:`megazero.tensor_parallel.recompute`): its pre-hook
  prefetches nothing (the unit needed next is the one *before* it, which the replay's own
  pre-backward hook fetches) and its post-hook keeps the unit for the backward that follows;
- when every bucket of the unit has its gradients (:meth:`Stage3Params.bucket_done`, called by
  the reducer), free it; the optimizer frees whatever is still gathered before each backward and
  at the end of the step (:meth:`Stage3Params.free_all`).

Each bucket gathers into one buffer for the whole run, and *freeing* resizes that buffer's
storage to 0 bytes (as FSDP does) instead of dropping it.  A linear layer's autograd node saves
``weight.t()``, a view of the gathered buffer; had the buffer been dropped, that view would keep
the whole gathered bucket alive until the micro-batch's backward, for every micro-batch in flight.
With the storage resized to 0 the saved view holds nothing, and the gather before the unit's
backward refills the same storage (parameters do not change within a step), so the view reads
the right values again.

So with or without recomputation a chunk holds its root unit (embedding, final norm, head) and at
most two blocks gathered at any moment: the one in use and the one being prefetched (a chunk that
sets ``zero3_free_root_in_backward``, as the GPT model does, has its root released once backward
reaches its blocks)
(``peak_gathered_bytes``; ``ZeroOptimizer.memory_bytes()["peak_param_bytes"]`` adds the shards).
Recomputing ``k`` layers as one group needs those ``k`` at once, plus one prefetched.

Everything keys off module hooks, so any pipeline schedule (interleaved forward and backward of
many micro-batches) works: each use gathers what it needs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

import torch

from megazero.process.distributed import gather_shards
from megazero.zero.buckets import Bucket


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a recomputation replay)."""
    return torch._C._current_graph_task_id() != -1


def tensor_leaves(obj) -> List[torch.Tensor]:
    """The tensors inside a module's inputs or outputs: through tuples, lists, mappings (a Hugging Face
    ``ModelOutput`` is one) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensor_leaves(x)]
    if isinstance(obj, Mapping):
        return [t for x in obj.values() for t in tensor_leaves(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensor_leaves(getattr(obj, f.name, None))]
    return []


@dataclass(frozen=True)
class Prefetch:
    """How far ahead ZeRO-3 gathers, after the unit in use (DeepSpeed's ``stage3_prefetch_bucket_size``
    and ``stage3_max_live_parameters``).

    ``numel``: the following units are gathered ahead while their elements add up to at most this
    (always the next one at least, unless 0: none); None: exactly the next unit.  ``max_live``: no
    unit is gathered ahead while that would put more than this many elements gathered at once (the
    unit in use is always gathered)."""
    numel: Optional[int] = None
    max_live: Optional[int] = None


class _Unit:
    def __init__(self, index: int, module: torch.nn.Module, chunk: int):
        self.index, self.module, self.chunk = index, module, chunk
        self.numel = 0  # elements of its buckets
        self.buckets: List[Bucket] = []
        self.full: Optional[Dict[int, torch.Tensor]] = None  # bucket index -> gathered buffer, while gathered
        self.buffers: Dict[int, torch.Tensor] = {}  # bucket index -> its buffer (storage empty when freed)
        self.handles: list = []
        self.done = 0  # buckets whose gradients are complete in the current backward
        self.after_read: list = []  # parameters on NVMe: (bucket, full, shard) to gather once read


class Stage3Params:
    """Owns the gather/free life cycle of every unit (see module docstring)."""

    def __init__(self, units: List[tuple], storage, mesh, dtype: torch.dtype,
                 prefetch: Prefetch = Prefetch()):
        """``units``: ``(module, chunk)`` per unit id; ``storage``: the
        :class:`~megazero.zero.storage.FlatStorage` holding this rank's parameter shards."""
        self.mesh, self.storage, self.prefetch = mesh, storage, prefetch
        buckets = storage.buckets
        self.units = [_Unit(i, m, c) for i, (m, c) in enumerate(units)]
        for b in buckets:
            self.units[b.unit].buckets.append(b)
            self.units[b.unit].numel += b.numel
        self.empty = torch.empty(0, dtype=dtype, device=mesh.device)
        self.gathered_bytes = self.peak_gathered_bytes = 0  # full buffers held now / at most so far
        self.gathered_numel = 0  # elements of the units gathered now
        self.order: Dict[int, List[_Unit]] = {}  # chunk -> its units in forward order (root first)
        for u in self.units:
            self.order.setdefault(u.chunk, [])
        for c in self.order:
            mine = [u for u in self.units if u.chunk == c]
            self.order[c] = [mine[-1]] + mine[:-1]  # the chunk (root) runs first, then its blocks
        self.trace: Dict[int, Optional[List[_Unit]]] = {c: [] for c in self.order}  # None: recorded
        for b in buckets:
            for p in b.params:
                p.data = self.empty  # sharded from now on
        self.hook_handles = []
        for u in self.units:
            self.hook_handles.append(u.module.register_forward_pre_hook(self._pre_forward_hook(u)))
            self.hook_handles.append(u.module.register_forward_hook(self._post_forward_hook(u),
                                                                    with_kwargs=True))

    # ---- gather / free ------------------------------------------------------------------
    def _next_in_forward(self, u: _Unit) -> Optional[_Unit]:
        """The unit whose forward follows ``u``'s: the chunk's root, then its blocks in order."""
        order = self.order[u.chunk]
        i = order.index(u) + 1
        return order[i] if i < len(order) else None

    def _next_in_backward(self, u: _Unit) -> Optional[_Unit]:
        """The unit whose backward follows ``u``'s: after the root (the head) the last block, then the
        blocks in reverse; after the first block none (the root is gathered, or released:
        :meth:`_release_root`)."""
        order = self.order[u.chunk]
        i = order.index(u)
        if i == 0:
            return order[-1] if len(order) > 1 else None
        return order[i - 1] if i > 1 else None

    def _prefetch(self, u: _Unit, step) -> None:
        """Start gathering the units after ``u`` (``step``: the next in forward or backward order) as
        far as :class:`Prefetch` allows."""
        ahead, taken = step(u), 0
        while ahead is not None:
            if self.prefetch.numel is not None and (taken + ahead.numel > self.prefetch.numel and
                                                    (taken or self.prefetch.numel == 0)):
                return
            if ahead.full is None:
                limit = self.prefetch.max_live
                if limit is not None and self.gathered_numel + ahead.numel > limit:
                    return
                self.gather(ahead, wait=False)
            if self.prefetch.numel is None:
                return
            taken += ahead.numel
            ahead = step(ahead)

    def _record(self, u: _Unit) -> None:
        """During a chunk's first forward: note the order its units are used in."""
        trace = self.trace[u.chunk]
        if trace is not None and u is not self.order[u.chunk][0] and u not in trace:
            trace.append(u)

    def _recorded(self, root: _Unit) -> None:
        """The chunk's first forward is over: its blocks are prefetched in the order it used them."""
        trace = self.trace[root.chunk]
        if trace is None:
            return
        rest = [x for x in self.order[root.chunk][1:] if x not in trace]
        self.order[root.chunk] = [root] + trace + rest
        self.trace[root.chunk] = None

    def gather(self, u: Optional[_Unit], wait: bool = True) -> None:
        if u is None:
            return
        swap = self.storage.swap  # --offload-param-device nvme: shards read from disk first
        if u.full is None:
            u.full, u.handles, u.after_read = {}, [], []
            self.gathered_numel += u.numel
            for b in u.buckets:  # (from disk in a group > 1: into a copy that only feeds the all-gather)
                shard = self.storage.param_shard(b) if swap is None else swap.fetch(b.index, home=b.dp == 1)
                if b.dp == 1:
                    u.full[b.index] = shard
                    continue
                full = u.buffers.get(b.index)
                if full is None:
                    full = u.buffers[b.index] = torch.empty(b.numel, dtype=shard.dtype, device=shard.device)
                else:  # the storage saved views still point at: allocate it again
                    full.untyped_storage().resize_(full.nbytes)
                self._count(full.nbytes)
                u.full[b.index] = full
                if swap is not None:  # the gather starts once the shard is read
                    u.after_read.append((b, full, shard))
                    continue
                u.handles.append(gather_shards(full, shard, group=self.mesh.group(*b.group), async_op=True))
        if wait and u.handles is not None:
            read = []  # in a group > 1 the copies read from disk, alive until their gathers are done
            if swap is not None:
                for b in u.buckets:
                    if b.dp == 1:
                        swap.ready(b.index)
                for b, full, shard in u.after_read:
                    read.append(swap.take(b.index))
                    u.handles.append(gather_shards(full, read[-1], group=self.mesh.group(*b.group),
                                                   async_op=True))
                u.after_read = []
            for h in u.handles:
                h.wait()
            u.handles, read = None, None
            for b in u.buckets if swap is not None else ():
                if b.dp > 1:  # the gathered buffer holds the shard: no second copy while in use
                    swap.evict(b.index)
            for b in u.buckets:
                full = u.full[b.index]
                for p, s, shape in zip(b.params, b.starts, b.shapes):
                    p.data = full[s:s + shape.numel()].view(shape)

    def free(self, u: _Unit, keep_views: bool = False) -> None:
        """Release ``u``'s gathered buffers (and shards read from NVMe); its parameters become empty,
        or with ``keep_views`` keep their shape as views of storage that holds nothing."""
        if u.full is None:
            return
        swap = self.storage.swap
        if u.after_read:  # gathered without waiting, never used: finish the reads, skip the gathers
            for b, full, shard in u.after_read:
                swap.ready(b.index)
            u.after_read = []
        for h in u.handles or ():
            h.wait()
        for b in u.buckets:
            for p in b.params:
                if not keep_views:
                    p.data = self.empty
        for b in u.buckets:
            if b.dp > 1:
                t = u.full[b.index]
                t.untyped_storage().resize_(0)  # views autograd saved now hold nothing
                self._count(-t.nbytes)
        if swap is not None:
            for b in u.buckets:
                swap.evict(b.index)  # the same for the shard on disk
        self.gathered_numel -= u.numel
        u.full, u.handles, u.done = None, [], 0

    def _count(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def free_all(self) -> None:
        for u in self.units:
            self.free(u)

    def gather_all(self) -> None:
        for u in self.units:
            self.gather(u)

    def bucket_done(self, b: Bucket) -> None:
        """The optimizer saw every gradient of ``b`` in this backward: free its unit once complete."""
        u = self.units[b.unit]
        u.done += 1
        if u.done >= len(u.buckets):
            self.free(u)

    def gathered_storages(self) -> set:
        """Identities (``UntypedStorage._cdata``) of the buffers gathered now."""
        return {t.untyped_storage()._cdata for u in self.units if u.full is not None for t in u.full.values()}

    def live_buffers(self) -> List[torch.Tensor]:
        """The gathered buffers held now (a bucket of a group of one is a view of its shard)."""
        return [u.full[b.index] for u in self.units if u.full is not None for b in u.buckets if b.dp > 1]

    # ---- hooks --------------------------------------------------------------------------
    def _release_root(self, u: _Unit) -> None:
        """Backward has reached block ``u``: the chunk's root unit is released if the chunk says its
        weights are no longer read (``zero3_free_root_in_backward``: a GPT chunk's head and final norm
        run their backward before the blocks', and a lookup needs no weights in backward).  Its
        parameters keep their shapes, for the gradients still to arrive; the next use gathers it."""
        root = self.order[u.chunk][0]
        if root is not u and root.full is not None and getattr(root.module, "zero3_free_root_in_backward",
                                                               False):
            self.free(root, keep_views=True)

    def _pre_forward_hook(self, u: _Unit):
        def hook(module, args):
            if _in_backward():  # a replay (activation recomputation): backward is past the root
                self._release_root(u)
            self.gather(u)
            if not _in_backward():
                self._record(u)
                self._prefetch(u, self._next_in_forward)
            # a replay inside backward (activation recomputation) prefetches nothing here: the
            # unit needed next is the one before it, fetched by the replay's pre-backward hook
        return hook

    def _post_forward_hook(self, u: _Unit):
        def hook(module, args, kwargs, output):
            if not _in_backward():  # a replay's backward follows at once: keep the unit until then
                self.free(u)
                if u is self.order[u.chunk][0]:
                    self._recorded(u)
            if torch.is_grad_enabled():
                inputs = {id(t) for t in tensor_leaves((args, kwargs))}
                for t in tensor_leaves(output):  # an input passed through is not this unit's output
                    if t.requires_grad and id(t) not in inputs:
                        t.register_hook(self._pre_backward_hook(u))
        return hook

    def _pre_backward_hook(self, u: _Unit):
        def hook(grad):
            self._release_root(u)
            self.gather(u)
            self._prefetch(u, self._next_in_backward)
        return hook
