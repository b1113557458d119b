"""``--compile``: each transformer layer's forward through ``torch.compile`` (Inductor).

Inductor fuses a layer's element-wise work (norms, activations, dropout, residual adds, rotary
embeddings) into a few generated kernels: C++/OpenMP ones on the CPU, Triton ones on a GPU.  Only
the layer's ``forward`` is compiled (an instance attribute over the class's), so hooks on the
module (ZeRO-3's parameter gathering, recomputation's bookkeeping) keep running eagerly around it,
parameter names and checkpoints do not change, and every layer of the same shape reuses one
compiled graph.  Random numbers come from the eager generators (Inductor's ``fallback_random``),
so dropout masks are eager's and recomputation replays them exactly.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional

import torch

INDUCTOR_OPTIONS = {"fallback_random": True}


def cpu_compiler() -> Optional[str]:
    """The C++ compiler Inductor's CPU backend would run (``$CXX``, else g++, c++ or clang++), or None."""
    wanted = os.environ.get("CXX")
    candidates = [wanted] if wanted else ["g++", "c++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


def check_compile(device_type: str) -> None:
    """Raises ValueError naming ``--compile`` when Inductor cannot build kernels for ``device_type``."""
    if device_type == "cpu" and cpu_compiler() is None:
        cxx = os.environ.get("CXX")
        found = f"$CXX={cxx} is not on PATH" if cxx else "no g++, c++ or clang++ on PATH"
        raise ValueError(f"--compile needs a C++ compiler for Inductor's CPU kernels ({found}); install "
                         "one (e.g. apt-get install g++) or set CXX, or leave out --compile")


def compile_layers(layers: Iterable[torch.nn.Module]) -> None:
    """Compile each module's ``forward`` in place (see the module docstring)."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, options=dict(INDUCTOR_OPTIONS))
