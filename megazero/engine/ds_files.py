"""DeepSpeed's checkpoint files as files: their names, the keys DeepSpeed writes itself, and
:func:`read_file`, ``torch.load(weights_only=True)`` with an allow-list of the few DeepSpeed classes
its files name (read as inert records: nothing of DeepSpeed's runs).  Shared by the readers of its
regular (:mod:`megazero.engine.ds_checkpoint`) and universal (:mod:`megazero.engine.ds_universal`)
checkpoints and by the writer (:mod:`megazero.engine.ds_save`)."""
from __future__ import annotations

import os
import re

import torch

from megazero.checkpoint.errors import CheckpointError

MODEL_STATES = "mp_rank_00_model_states.pt"
KEYS = ("master", "exp_avg", "exp_avg_sq")  # the fp32 state a rank's optimizer file holds a partition of
OPTIM_NAME = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# the model-states keys DeepSpeed writes itself; the rest is the client_state a script saved
DS_KEYS = frozenset((
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions"))


class StoredRecord:
    """What an allowed DeepSpeed object in a checkpoint becomes: its saved attributes, no behaviour."""


def stored_enum(value):
    """An allowed DeepSpeed enum member in a checkpoint becomes its plain value."""
    return value


_LS = "deepspeed.runtime.fp16.loss_scaler."
STORED = {_LS + "LossScaler": StoredRecord, _LS + "DynamicLossScaler": StoredRecord,
          _LS + "LossScaleProfile": stored_enum,
          "deepspeed.runtime.zero.config.ZeroStageEnum": stored_enum,
          "deepspeed.utils.tensor_fragment.fragment_address": StoredRecord}


def is_deepspeed_checkpoint(path: str) -> bool:
    """Whether ``path`` (a tag's directory) holds DeepSpeed's files rather than megazero's."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    universal = os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt"))  # ds_to_universal.py's
    return universal or any(n.endswith("model_states.pt") or OPTIM_NAME.match(n) for n in names)


def read_file(path: str):
    """``torch.load(weights_only=True)`` of one DeepSpeed file, :data:`STORED` read as records; every
    failure is one :class:`CheckpointError` naming the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the DeepSpeed checkpoint is incomplete (every rank that "
                              "saved it writes its own file); copy the whole tag directory")
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in STORED.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - whatever the bytes are: one line naming the file
        text = str(err)
        named = re.search(r"GLOBAL (\S+)", text) or re.search(r"unrecognized function (\S+)", text)
        if named:
            raise CheckpointError(f"{path} is refused: it names {named.group(1)}, not one of the plain "
                                  "types a DeepSpeed checkpoint holds; megazero runs no code from a "
                                  "checkpoint") from None
        first = text.strip().splitlines()[0].split(". ")[0] if text.strip() else type(err).__name__
        raise CheckpointError(f"{path} cannot be read ({first[:160]}): truncated or not a torch.save file; "
                              "copy it again from the run that saved it") from None
