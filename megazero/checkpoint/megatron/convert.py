"""A Megatron-LM checkpoint -> a megazero checkpoint of weights (one process), which ``--load`` then
reads at any layout.

The conversion keeps the trainer state Megatron-LM stored: the iteration, the consumed samples
(``args.consumed_train_samples``) and the samples the learning-rate schedule has counted
(``opt_param_scheduler.num_steps``), as a resumed megazero run keeps its own, and (``optimizer``)
Adam's moments, step and schedule settings (:mod:`~.optim_state`); without them the optimizer starts
fresh.  The generators are reseeded from ``(seed, iteration)``.
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.files import MegatronCheckpoint, trainer_extra
from megazero.checkpoint.megatron.mapping import NameMap
from megazero.checkpoint.megatron.optim_state import optimizer_state, write_with_optimizer

IMPORT_DIR = "megazero_import"  # inside --load: the converted copy, replaced at every start


def _check_shape(ck, name: str, got: torch.Tensor, want) -> None:
    if tuple(got.shape) != tuple(want):
        raise CheckpointError(f"--load {ck.directory}: {name} is {tuple(got.shape)} in the Megatron-LM "
                              f"checkpoint but {tuple(want)} in this model; pass --use-checkpoint-args or "
                              "the checkpoint's --num-layers/--hidden-size/--ffn-hidden-size/... flags")


def convert(src: str, dst: str, whole, model_provider, iteration: Optional[int] = None,
            ckpt_format: Optional[str] = None, optimizer=None) -> str:
    """Write the weights of Megatron-LM checkpoint ``src`` (its tracker's iteration, or ``iteration``) as
    a megazero checkpoint in ``dst`` for the model ``model_provider(whole, mesh)`` builds, ``whole`` the
    validated one-process configuration (:func:`megazero.config.one_process_model` of a run's);
    returns its path.  One process; the model is built on the meta device, each weight read as it is
    written.  ``optimizer``: the run's optimizer settings (``cfg.optimizer``) to convert the Adam state
    stored with the checkpoint for (:mod:`~.optim_state`; none stored: the weights alone)."""
    from megazero.checkpoint.writer import save_weights
    from megazero.mesh import ParallelMesh
    par = whole.parallel
    if par.world_size != 1 or par.tensor_model_parallel_size != 1 or par.pipeline_model_parallel_size != 1:
        raise ValueError("convert() writes the whole model: pass the one-process configuration "
                         "(megazero.config.one_process_model)")
    ck = MegatronCheckpoint(src, iteration, ckpt_format)
    layers = _saved_layers(ck)
    if layers is not None and layers != whole.model.num_layers:
        raise CheckpointError(f"--load {src}: the Megatron-LM checkpoint has {layers} layers, this model "
                              f"{whole.model.num_layers}; pass --use-checkpoint-args or "
                              f"--num-layers {layers}")
    with torch.device("meta"):
        built = model_provider(whole, ParallelMesh.single(torch.device("meta")))
    chunks = [built] if isinstance(built, torch.nn.Module) else list(built)
    one_p = bool(ck.args is not None and getattr(ck.args, "apply_layernorm_1p", False))
    names = NameMap(ck, whole, layernorm_1p=one_p)
    vocab = whole.model.vocab_size

    def values(name, p):
        t = names.tensor(name)
        want = (vocab,) + tuple(p.shape[1:]) if name in ("word_embeddings.weight", "output_layer.weight") \
            else tuple(p.shape)
        if name in ("word_embeddings.weight", "output_layer.weight") and t.shape[0] < vocab:
            raise CheckpointError(f"--load {src}: {name} has {t.shape[0]} rows in the Megatron-LM "
                                  "checkpoint, "
                                  f"fewer than --vocab-size {vocab}")
        _check_shape(ck, name, t, want)
        return t.contiguous()
    for chunk in chunks:  # every name maps before anything is written
        for name, _ in chunk.named_parameters():
            names.source(name) or names.tensor(name)
    state = optimizer_state(ck) if optimizer is not None else None
    if state is not None:
        return write_with_optimizer(ck, state, dst, chunks, whole, values, optimizer)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    return save_weights(dst, chunks, ParallelMesh.single(), whole, iteration=ck.iteration,
                        extra=trainer_extra(ck), values=values)


def _saved_layers(ck: MegatronCheckpoint) -> Optional[int]:
    if ck.format == "torch":
        return ck.num_layers
    shape = ck.shapes.get("decoder.layers.self_attention.linear_qkv.weight")
    return shape[0] if shape else None
