"""Command-line programs, each in its own module (``pretrain``, ``estimate_memory``, ``plan``,
``preprocess``), and the console entry points installed by ``pip install``: ``megazero-pretrain``,
``megazero-estimate-memory``, ``megazero-plan`` and ``megazero-launch`` (the same programs as
``scripts/pretrain_gpt.py``, ``scripts/estimate_memory.py``, ``scripts/plan.py`` and
``scripts/launch.py``)."""
from __future__ import annotations

import sys
from typing import List, Optional

from megazero.errors import EXIT_USAGE


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


def launch_main(argv: Optional[List[str]] = None) -> int:
    """``scripts/launch.py`` / ``megazero-launch``: torchrun with the same flags, speaking once
    (:mod:`megazero.resilience.launcher`).  Its own options come first: ``--signal-grace SECS`` (or
    MEGAZERO_SIGNAL_GRACE; default 120): how long repeated termination signals count as one request;
    ``--join-timeout SECS`` (or MEGAZERO_JOIN_TIMEOUT; default 600, 0 for none): how long a node waits
    for the other nodes before it names the missing ones and exits 1 (:mod:`megazero.resilience.join`)."""
    import os
    from megazero.resilience.launcher import run_torchrun
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {"--signal-grace": os.environ.get("MEGAZERO_SIGNAL_GRACE", "120"),
           "--join-timeout": os.environ.get("MEGAZERO_JOIN_TIMEOUT", "600")}
    while argv[:1] and argv[0] in own and len(argv) > 1:
        own[argv[0]], argv = argv[1], argv[2:]
    seconds = {}
    for flag, value in own.items():
        try:
            seconds[flag] = float(value)
        except ValueError:
            seconds[flag] = -1.0
        if not seconds[flag] >= 0:
            sys.stderr.write(f"launch.py: error: {flag} needs seconds (0 or more), got {value!r}\n")
            return EXIT_USAGE
    return run_torchrun(argv, seconds["--signal-grace"], join_timeout=seconds["--join-timeout"])


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
