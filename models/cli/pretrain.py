"""``scripts/pretrain_gpt.py`` / ``megazero-pretrain``: parse and validate the flags, then train
(:func:`megazero.training.train`)."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

from megazero.config import ConfigError, parse_args
from megazero.data import build_data
from megazero.errors import EXIT_OK
from megazero.training import ModelProvider, train


def _check_swap_dir(cfg) -> None:
    """--nvme-path missing or read-only: a usage error before the model is built."""
    from megazero.offload.checks import NvmePathError
    from megazero.offload.settings import check_swap_dir
    try:
        check_swap_dir(cfg.parallel)
    except NvmePathError as err:
        raise ConfigError(str(err)) from None


def main(argv: Optional[Sequence[str]] = None, model_provider: Optional[ModelProvider] = None,
         presets: Optional[Dict[str, dict]] = None) -> int:
    """``pretrain_gpt.py``: parse and validate the flags (before any process-group work), train.

    Returns the exit status: 0 (also after a clean early stop: signal, time or iteration limit), 2
    for an invalid flag combination or a checkpoint that cannot be used, 1 for any other failure.
    Each failure is printed once, without a traceback when it is an expected kind
    (:func:`megazero.resilience.report_failure`); under torchrun the process ends with its launcher
    (:func:`megazero.resilience.exit_with_parent`)."""
    from megazero.resilience import exit_with_parent, report_failure
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = parse_args(argv, presets, world_size=world)
        build_data(cfg)  # fails early for data settings this build cannot serve
        if not cfg.logging.dry_run:  # the directory is the training machine's
            _check_swap_dir(cfg)
        if cfg.logging.tensorboard_dir:
            from megazero.training.log import tensorboard_writer_class
            try:
                tensorboard_writer_class()
            except ImportError as err:
                raise ConfigError(str(err)) from None
    except ConfigError as err:
        return report_failure(err)  # rank 0 prints it; the others wait for the launcher to end them
    if cfg.logging.dry_run:
        from megazero.training.summary import parameter_line, provider_stage_counts
        from .. import build_chunks
        for note in cfg.notes:  # what a run would say at start-up about the flags (ignored ones, warnings)
            print(f"megazero: {note}")
        par = cfg.parallel
        print(f"dry run: the flags are valid for {world} ranks: tp {par.tensor_model_parallel_size} "
              f"pp {par.pipeline_model_parallel_size} dp {par.data_parallel_size} zero {par.zero_stage}; "
              f"{parameter_line(cfg, provider_stage_counts(cfg, model_provider or build_chunks))}")
        return EXIT_OK
    if model_provider is None:
        raise ValueError("main() needs a model_provider(cfg, mesh) returning this rank's model chunks")
    try:
        train(cfg, model_provider, keep_history=False)  # rows streamed, not kept
    except Exception as err:  # noqa: BLE001 - reported once, with its exit status (megazero.errors)
        return report_failure(err)
    return EXIT_OK
