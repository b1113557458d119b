"""``pretrain_gpt.py --load`` of a Megatron-LM checkpoint: converted at start-up into a megazero
checkpoint of weights (:mod:`megazero.checkpoint.megatron`), which the run then loads at its layout;
one that ``--ckpt-format torch_dist`` saved resumes from megazero's own checkpoint beside it
(:mod:`megazero.checkpoint.megatron.save`)."""
from __future__ import annotations

import os
from dataclasses import replace

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron import IMPORT_DIR, READABLE, convert, is_megatron_dir
from megazero.checkpoint.megatron.save import resume_source
from megazero.config import one_process_model


def import_for_load(cfg, model_provider, mesh):
    """``cfg`` unchanged when ``--load`` is not a Megatron-LM checkpoint; else (collective) rank 0
    converts it and ``cfg`` with ``--load`` naming the converted directory is returned."""
    from megazero.checkpoint.comm import on_rank0
    ck = cfg.checkpoint
    fmt = getattr(ck, "ckpt_format", None)

    def run():
        own = resume_source(ck.load, ck.ckpt_step)  # what --ckpt-format torch_dist saved: megazero's own
        if own is not None:
            return own
        if not is_megatron_dir(ck.load, ck.ckpt_step):
            return None
        if fmt not in (None,) + READABLE:
            raise CheckpointError(f"--ckpt-format {fmt}: megazero reads Megatron-LM's torch_dist and torch "
                                  f"checkpoints only; {ck.load} is a Megatron-LM checkpoint")
        dst = os.path.join(ck.load, IMPORT_DIR)
        try:
            convert(ck.load, dst, one_process_model(cfg), model_provider, ck.ckpt_step, fmt,
                    optimizer=None if ck.finetune or ck.no_load_optim else cfg.optimizer)  # Adam's state
        except PermissionError as err:
            raise CheckpointError(f"--load {ck.load}: cannot write the converted copy ({err}); convert it "
                                  "with scripts/convert_megatron.py --input DIR --output OUT and --load OUT")
        return dst
    converted = on_rank0(run, mesh)
    if converted is None:
        return cfg
    if isinstance(converted, (tuple, list)):  # megazero's checkpoint of the iteration the tracker names
        return replace(cfg, checkpoint=replace(ck, load=converted[0], ckpt_step=int(converted[1])))
    return replace(cfg, checkpoint=replace(ck, load=converted))
