"""Megatron-LM checkpoints read by megazero: ``--load DIR`` where DIR holds Megatron-LM's
``torch_dist`` format or its legacy ``mp_rank_XX[_YYY]/model_optim_rng.pt`` format (``--ckpt-format``
``torch_dist`` / ``torch`` names which one is expected; unset, either is detected).

At start-up (:func:`megazero.training.megatron_import.import_for_load`, collective) global rank 0
converts the checkpoint into a megazero checkpoint of weights in ``DIR/megazero_import/`` (replaced
at every start; the source is only read), keeping the iteration, the consumed samples and the
learning-rate schedule's sample count (dense and mixture-of-experts GPT weights: :mod:`~.mapping`);
the run then loads that at its own layout (any TP, PP, DP, ZeRO stage), as it loads its own
checkpoints. Adam's state is converted with the weights when the checkpoint stores it and neither
``--no-load-optim`` nor ``--finetune`` is given (:mod:`~.optim_state`); the generators are reseeded
from ``(seed, iteration)``.
``--finetune`` keeps its meaning (weights only, iteration 0); ``--use-checkpoint-args`` reads
Megatron-LM's stored ``args`` (:func:`saved_config`).

Modules: :mod:`~.safe_load` (pickles read with an allow-list, never executed), :mod:`~.files` (the
layout on disk, tensors read whole), :mod:`~.mapping` (names and arguments), :mod:`~.convert`,
:mod:`~.optim_state`, :mod:`~.optim_legacy` and :mod:`~.optim_write` (the optimizer's state).
"""
from __future__ import annotations

import os
from typing import Optional

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.convert import IMPORT_DIR, convert
from megazero.checkpoint.megatron.files import TRACKER, MegatronCheckpoint, format_of, iteration_dir
from megazero.checkpoint.megatron.mapping import moe_settings_from_args, settings_from_args

READABLE = ("torch_dist", "torch")

__all__ = ["IMPORT_DIR", "READABLE", "convert", "is_megatron_dir", "saved_config"]


def is_megatron_dir(directory: str, iteration: Optional[int] = None) -> bool:
    """Whether ``directory`` is a Megatron-LM checkpoint directory (its tracker's or ``iteration``'s
    ``iter_*`` directory holds Megatron-LM's files and no megazero metadata)."""
    if not os.path.isfile(os.path.join(directory, TRACKER)) and iteration is None:
        return False
    try:
        path, _ = iteration_dir(directory, iteration)
    except CheckpointError:
        return False
    return format_of(path) is not None


def saved_config(directory: str, iteration: Optional[int] = None) -> dict:
    """The configuration ``--use-checkpoint-args`` takes, from Megatron-LM's stored ``args``."""
    ck = MegatronCheckpoint(directory, iteration)
    if ck.args is None:
        raise CheckpointError(f"--use-checkpoint-args: {ck.path} stores no Megatron-LM args; give the "
                              "model's flags instead")
    return {"model": settings_from_args(ck.args), "moe": moe_settings_from_args(ck.args), "data": {}}
