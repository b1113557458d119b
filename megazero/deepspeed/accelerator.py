"""DeepSpeed's ``get_accelerator()`` over megazero's device choice: ``from deepspeed.accelerator import
get_accelerator`` becomes ``from megazero.deepspeed.accelerator import get_accelerator``.

The accelerator is the device megazero trains on (:func:`megazero.mesh.default_device`): CUDA where a
GPU is visible, else the CPU, with DeepSpeed's method names for what training scripts ask of it
(device names and indices, availability, the collective backend, supported half-precision types,
seeding, synchronisation, memory statistics, pinned memory).  A method DeepSpeed's accelerators have
and this one does not is an ``AttributeError`` of one line naming it and what exists.
"""
from __future__ import annotations

from typing import Optional

import torch

from megazero.mesh import backend_for, default_device
from megazero.planning.hardware import host_memory_bytes


class Accelerator:
    """DeepSpeed's accelerator interface for CUDA or the CPU (``name`` says which)."""

    def __init__(self, device: torch.device):
        self._device = torch.device(device.type)
        self._name = device.type
        self._cuda = device.type == "cuda"

    # ---- devices ----------------------------------------------------------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"`` / ``"cuda:<i>"``, or ``"cpu"`` whatever the index (as DeepSpeed's CPU accelerator)."""
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._cuda else self._name

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return backend_for(self._device)

    def is_synchronized_device(self) -> bool:
        """True where work runs in program order (the CPU), as DeepSpeed's accelerators say."""
        return not self._cuda

    # ---- precision --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float32, torch.bfloat16, torch.float16]

    # ---- random numbers -----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # ---- memory -------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return int(host_memory_bytes())

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        have = ", ".join(sorted(n for n in dir(type(self)) if not n.startswith("_")))
        raise AttributeError(f"megazero's get_accelerator() has no {name}() (DeepSpeed's accelerators "
                             f"do); it has: {have}")


def get_accelerator() -> Accelerator:
    """The accelerator of this process: CUDA where a GPU is visible, else the CPU."""
    return Accelerator(default_device())
