"""Stages 1/2: the all-gather of the updated parameters overlapped with the next forward.

After the optimizer step each DP rank holds the new values of its slice of every bucket only;
an all-gather per bucket brings everyone's slices back (Megatron-LM's ``--overlap-param-gather``).
Instead of waiting for them inside ``step()``, :class:`OverlappedParamGather` launches the
gathers in the order the forward uses the buckets and lets each *unit* wait for its own buckets
just before its forward (a forward pre-hook), so the gathers of later layers run while earlier
layers compute.

Units are those of ZeRO-3 (:func:`megazero.zero.buckets.find_units`): each block of a chunk's
largest ``ModuleList`` (its transformer layers), and the chunk itself for every other parameter
(embedding, final norm, head), which may be used anywhere in the chunk's forward and is waited
for when the chunk's forward starts.  The bucket layout puts cuts between the parameters
registered before the blocks, the blocks and those registered after them
(:func:`megazero.zero.buckets.bucket_groups`), so the chunk's own parameters share no bucket
with a layer and the chunk's first wait covers only them.

Anything that reads parameters outside a forward must call :meth:`finish` first (the optimizer
does in ``step()``, ``gathered_params()`` and when loading; the trainer at the end of training).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megazero.zero.buckets import Bucket, default_blocks


class OverlappedParamGather:
    """Pending parameter all-gathers of stages 1/2 and the forward pre-hooks that wait for them."""

    def __init__(self, chunks: Sequence[torch.nn.Module], buckets: List[Bucket],
                 blocks: Callable = default_blocks):
        bucket_of = {id(p): b.index for b in buckets for p in b.params}
        self.pending: Dict[int, object] = {}  # bucket index -> work handle of its all-gather
        self.order: List[int] = []  # bucket indices in the order the forward needs them
        self.hooks = []
        for chunk in chunks:
            for module, wanted in self._unit_buckets(chunk, bucket_of, blocks):
                self.order += [i for i in wanted if i not in self.order]
                self.hooks.append(module.register_forward_pre_hook(self._waiter(wanted)))
        self.order += [b.index for b in buckets if b.index not in self.order]  # parameters of no unit

    @staticmethod
    def _unit_buckets(chunk: torch.nn.Module, bucket_of: Dict[int, int],
                      blocks: Callable = default_blocks) -> List[Tuple[torch.nn.Module, List[int]]]:
        """``(module, bucket indices)`` per unit of ``chunk`` in forward order: the chunk first (its
        own parameters), then its blocks (``blocks(chunk)``: ``(module, parameters)`` each)."""
        units, out = blocks(chunk), []
        in_block = {id(p) for _, ps in units for p in ps}
        own = [p for p in chunk.parameters() if id(p) not in in_block]
        for module, params in [(chunk, own)] + list(units):
            wanted = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of}, reverse=True)
            out.append((module, wanted))
        return out

    def _waiter(self, wanted: List[int]):
        def hook(module, args):
            for i in wanted:
                work = self.pending.pop(i, None)
                if work is not None:
                    work.wait()
        return hook

    def launched(self, b: Bucket, work) -> None:
        """Bucket ``b``'s all-gather was started (``work`` None: nothing to wait for)."""
        if work is not None:
            self.pending[b.index] = work

    def finish(self) -> None:
        """Wait for every gather still in flight (before reading parameters outside a forward)."""
        for i in list(self.pending):
            self.pending.pop(i).wait()
        self.hooks = []
