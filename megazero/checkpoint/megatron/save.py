"""``pretrain_gpt.py --save DIR --ckpt-format torch_dist``: every save of the run also in Megatron-LM's
layout, which megatron-core's ``dist_checkpointing.load`` (and Megatron-LM's ``--load DIR``) reads.

What a save writes::

    DIR/megazero_state/                    megazero's own checkpoint (every rank its shards, collectively:
                                           weights, optimizer, generators, data position), sealed and
                                           published as any megazero save (docs/checkpointing.md)
    DIR/iter_XXXXXXX/                      Megatron-LM's torch_dist checkpoint of the published iteration
                                           (:func:`~.export.export`: megatron-core's sharded names,
                                           common.pt with Megatron's args, iteration, consumed samples)
    DIR/latest_checkpointed_iteration.txt  Megatron-LM's tracker

The Megatron-LM files are written once the megazero checkpoint is published, by every rank at once
(:mod:`~.dcp_plan`): each writes its share of the chunks (a layer of a tensor each), read back from
megazero's files as it writes them, so a rank holds one layer's tensor at a time (the shards are
regrouped through the file system, which every rank must see, as for loading at another layout).
Float32 weights and (Adam) the optimizer's moments and step (:mod:`~.export`).

``--load DIR`` (any ``--ckpt-format``) resumes megazero from ``megazero_state`` when it holds the
iteration the tracker names (optimizer, generators and data position included: as if the run had
gone on); an iteration Megatron-LM wrote itself is converted (:mod:`~.convert`, Adam's state included).
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional, Tuple

from megazero.checkpoint.megatron.export import unmapped
from megazero.checkpoint.megatron.files import TRACKER, format_of, iteration_dir

STATE_DIR = "megazero_state"  # inside --save: megazero's own checkpoints of the run


def state_dir(directory: str) -> str:
    return os.path.join(directory, STATE_DIR)


def not_written(model: dict, moe: dict) -> Optional[str]:
    """Why ``--ckpt-format torch_dist`` cannot write this model in Megatron-LM's layout (None: it can)."""
    why = unmapped(model, moe)
    return None if why is None else f"--ckpt-format torch_dist: {why}"


def _layout(cfg) -> dict:
    par = cfg.parallel
    return {"tensor_model_parallel_size": par.tensor_model_parallel_size,
            "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
            "world_size": par.world_size}


def _scheduler(cfg) -> dict:
    opt = cfg.optimizer
    return {"max_lr": opt.lr, "min_lr": opt.min_lr, "lr_decay_style": opt.lr_decay_style}


def write_megatron(cfg, iteration: int, mesh) -> str:
    """Published ``iteration`` of ``--save``'s ``megazero_state`` in Megatron-LM's layout under
    ``--save`` (collective: every rank writes its share of the chunks, :mod:`~.dcp_plan`; global rank 0
    then ``common.pt``, the rename and the tracker); returns the ``iter_*`` path."""
    from megazero.checkpoint.comm import agree, on_rank0
    from megazero.checkpoint.errors import CheckpointSaveError
    from megazero.checkpoint.megatron.dcp_plan import write_tensors
    from megazero.checkpoint.megatron.export import finish, start
    save = cfg.checkpoint.save
    part = on_rank0(lambda: start(os.path.join(save, f"iter_{iteration:07d}")), mesh)
    error, got = None, None
    try:
        group = mesh.world_group if mesh.is_distributed else None
        got = write_tensors(state_dir(save), iteration, part, mesh.rank, mesh.world_size, group)
    except Exception as err:  # noqa: BLE001 - every rank learns of it below
        error = err
    agree(error, mesh, f"writing Megatron-LM's checkpoint {part}", CheckpointSaveError)
    return on_rank0(lambda: finish(part, save, got[0], got[1], _layout(cfg), _scheduler(cfg)), mesh)


def prune_megatron(directory: str, removed: Iterable[str]) -> None:
    """Remove Megatron-LM's ``iter_*`` directories of the megazero checkpoints ``--ckpt-keep`` removed
    (one process; never the one the tracker names)."""
    try:
        _, tracked = iteration_dir(directory)
    except Exception:  # noqa: BLE001 - no tracker (yet): remove nothing it could name
        tracked = None
    for path in removed:
        name = os.path.basename(path.rstrip(os.sep))
        mine = os.path.join(directory, name)
        if name.startswith("iter_") and name[5:].isdigit() and int(name[5:]) != tracked and \
                format_of(mine) == "torch_dist":
            shutil.rmtree(mine, ignore_errors=True)


def resume_source(directory: str, iteration: Optional[int]) -> Optional[Tuple[str, int]]:
    """``(megazero_state dir, iteration)`` when megazero wrote the Megatron-LM checkpoint of
    ``directory`` that ``--load`` (and ``--ckpt-step``) names, with its own complete checkpoint of that
    iteration beside it; else None (one process)."""
    from megazero.checkpoint.resolve import complete_iterations
    side = state_dir(directory)
    if not os.path.isdir(side):
        return None
    if iteration is None and not os.path.isfile(os.path.join(directory, TRACKER)):
        done = complete_iterations(side)  # the megazero save published, its Megatron copy not written
        return (side, done[0]) if done else None
    try:
        _, it = iteration_dir(directory, iteration)
    except Exception:  # noqa: BLE001 - the Megatron reader explains a damaged directory
        return None
    return (side, it) if it in complete_iterations(side) else None
