"""Offload of model state to a local disk (ZeRO-Infinity-like): swap files of named tensors with
asynchronous direct I/O, and the sub-group streaming an optimizer step needs.  See docs/offload.md."""
from megazero.offload.aligned import ALIGN, aligned_empty
from megazero.offload.checks import NvmePathError, NvmeSpaceError, SwapCorruptError, check_nvme_path
from megazero.offload.handles import IOCounts, IOHandle, IOStats
from megazero.offload.lock import SwapBusyError
from megazero.offload.nvme import DEFAULT_BLOCK_SIZE, DEFAULT_IO_THREADS, NvmeStore, swap_bytes
from megazero.offload.streamer import Streamer

SwapFile = NvmeStore  #: the same class under the name the design notes use

__all__ = ["ALIGN", "DEFAULT_BLOCK_SIZE", "DEFAULT_IO_THREADS", "IOCounts", "IOHandle", "IOStats",
           "NvmePathError", "NvmeSpaceError", "NvmeStore", "Streamer", "SwapBusyError", "SwapCorruptError",
           "SwapFile", "aligned_empty", "check_nvme_path", "swap_bytes"]
