"""The trainer's micro-batches step after step, with the next step's loaded ahead.

:class:`StepBatches` cuts each training step's batch with :func:`megazero.data.micro_batches` (so
the samples are those of every other layout), builds only the tensors this pipeline stage reads
(:func:`megazero.data.stage_keys`) and moves them with pinned, non-blocking copies.  On a device
other than the CPU the trainer calls :meth:`StepBatches.ahead` once the step's forward and backward
are queued: the next step's samples are read, pinned and their copies queued while the device still
computes, and the next :meth:`StepBatches.get` takes them without waiting.  On the CPU there is
nothing to overlap (the host is the device), so batches are read when asked for.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megazero.data import micro_batches


class StepBatches:
    """This rank's micro-batches of each training step (``source``: a token source)."""

    def __init__(self, source, micro_batch_size: int, dp_rank: int, dp_size: int, device: torch.device,
                 keys: Sequence[str], batch_size_at: Callable[[int], int] = lambda consumed: 0,
                 prefetch: Optional[bool] = None):
        self.source, self.micro_batch_size = source, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device, self.keys = torch.device(device), tuple(keys)
        self.batch_size_at = batch_size_at  # samples consumed -> the next step's global batch size
        self.prefetch = self.device.type != "cpu" if prefetch is None else prefetch
        self.pending: Optional[Tuple[Tuple[int, int], List[Dict[str, torch.Tensor]]]] = None
        self.prefetched = 0  # steps served from the prefetch (for tests and curiosity)

    def load(self, first: int, size: int) -> List[Dict[str, torch.Tensor]]:
        return micro_batches(self.source, None, size, self.micro_batch_size, self.dp_rank, self.dp_size,
                             device=self.device, first=first, keys=self.keys)

    def get(self, first: int, size: int) -> List[Dict[str, torch.Tensor]]:
        """The micro-batches of the ``size`` samples from sample ``first`` (prefetched when they were)."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == (first, size):
            self.prefetched += 1
            return pending[1]
        return self.load(first, size)

    def ahead(self, first: int) -> None:
        """Load the batch of the step that starts at sample ``first`` now (with prefetching on;
        nothing otherwise)."""
        size = self.batch_size_at(first)
        if self.prefetch and size > 0:
            self.pending = ((first, size), self.load(first, size))
