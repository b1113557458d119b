"""Command-line programs, each in its own module (``pretrain``, ``estimate_memory``, ``plan``,
``preprocess``), and the console entry points installed by ``pip install``: ``megazero-pretrain``,
``megazero-estimate-memory`` and ``megazero-plan`` (the same programs as
``scripts/pretrain_gpt.py``, ``scripts/estimate_memory.py`` and ``scripts/plan.py``)."""
from __future__ import annotations

import sys
from typing import List, Optional


def model_provider(cfg, mesh):
    """This rank's GPT model chunks (one per virtual pipeline stage)."""
    from .. import build_chunks
    return build_chunks(cfg, mesh)


def pretrain_main(argv: Optional[List[str]] = None) -> int:
    """Pretrain a GPT model (run under torchrun for several processes)."""
    from ..presets import PRESETS
    from .pretrain import main
    return main(sys.argv[1:] if argv is None else argv, model_provider, PRESETS)


def pretrain_entry(argv: Optional[List[str]] = None) -> None:
    """The ``megazero-pretrain`` console script: :func:`pretrain_main`, then the process ends with its
    exit status without the interpreter's finalization (see :func:`megazero.resilience.exit_process`)."""
    from megazero.resilience import exit_process
    exit_process(pretrain_main(argv))


def estimate_memory_main(argv: Optional[List[str]] = None) -> int:
    """Per-rank memory per component for each ZeRO stage; ``--measure``, ``--json``, ``--plot``."""
    from ..presets import PRESETS
    from .estimate_memory import main
    return main(argv, PRESETS, model_provider)


def plan_main(argv: Optional[List[str]] = None) -> int:
    """Rank the layouts that fit a cluster by estimated step time (``--json`` for a list)."""
    from ..presets import PRESETS
    from .plan import main
    return main(argv, PRESETS)
