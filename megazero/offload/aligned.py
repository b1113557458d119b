"""Host memory that direct I/O accepts: aligned to a page, sized in whole pages, pinned on CUDA.

``O_DIRECT`` wants the buffer address, the file offset and the length to be multiples of the
device's logical block size (512 or 4096 bytes); :data:`ALIGN` = 4096 satisfies both.  A buffer is
carved out of a slightly larger ``torch.empty`` (pinned with ``pin_memory=True`` when CUDA is
used, so host <-> device copies can be ``non_blocking``), starting at its first aligned byte.
"""
from __future__ import annotations

import torch

ALIGN = 4096  #: address, offset and length granule of direct I/O (bytes)


def round_up(n: int, granule: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``granule``."""
    return -(-n // granule) * granule


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A ``uint8`` CPU tensor of ``round_up(nbytes)`` bytes whose first byte is :data:`ALIGN`-aligned
    (pinned when ``pin``).  Its contents are undefined, as with ``torch.empty``."""
    size = round_up(max(nbytes, 1))
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift:shift + size]


def is_aligned(t: torch.Tensor) -> bool:
    """Whether direct I/O can use ``t``'s memory in place: a contiguous CPU tensor at an aligned address."""
    return t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() % ALIGN == 0


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of the bytes of the contiguous CPU tensor ``t`` (shares its memory)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def typed_view(buf: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` elements of ``dtype`` starting at byte ``offset`` of the ``uint8`` tensor ``buf``."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype)
