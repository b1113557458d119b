"""Converting between Hugging Face directories and megazero checkpoints one tensor at a time (what
``scripts/convert_hf.py`` runs): the model is never held whole, so a 7B model converts in a few GB.

- :func:`to_megazero`: the megazero model is built on the meta device (names, shapes, layouts, no
  memory); each parameter is made from the Hugging Face tensors it needs, read from the safetensors
  files as it is written; the tokenizer files and ``generation_config.json`` go to ``DST/hf_files``,
  which the checkpoint's configuration names as its tokenizer, with the source's bos/eos/pad ids
  (``megazero_token_ids.json``: an export writes them into its ``config.json``).
- :func:`to_hf`: each parameter of the checkpoint is read alone (any saved layout), split into its
  Hugging Face tensors and streamed into ``model-0000i-of-0000N.safetensors`` shards of
  ``--max-shard-size`` (with ``model.safetensors.index.json``) in ``--dtype``; then ``config.json``,
  ``generation_config.json`` and the tokenizer.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megazero.config import config_from_dict, validate
from megazero.mesh import ParallelMesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
            "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
ASSETS = "hf_files"  # beside the iter_* directories of a converted checkpoint
TOKEN_IDS = "megazero_token_ids.json"  # in ASSETS: the source config's special ids, which an export keeps
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _whole_model_cfg(settings: dict):
    whole = dict(settings, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, mock_data=True)
    return validate(config_from_dict(whole), 1)


def to_megazero(src: str, dst: str) -> str:
    """Hugging Face directory ``src`` -> checkpoint directory ``dst`` (iteration 0, weights only)."""
    from transformers import AutoConfig
    from megazero.checkpoint import save_weights
    from . import build_model
    from .hf import config_from_hf, megazero_names, megazero_tensor
    from .safetensors_io import HFWeights
    hf_config = AutoConfig.from_pretrained(src)
    cfg = _whole_model_cfg(config_from_hf(hf_config))
    meta = ParallelMesh.single(torch.device("meta"))
    with torch.device("meta"):
        skeleton = build_model(cfg, meta)
    names = megazero_names(cfg)
    built = [n for n, _ in skeleton.named_parameters()]
    if sorted(names) != sorted(built):
        raise RuntimeError(f"the Hugging Face mapping names {sorted(set(names) ^ set(built))} differently "
                           "from the model")
    weights = HFWeights(src)
    if _copy_hf_files(src, os.path.join(dst, ASSETS)):
        cfg.data.tokenizer_model, cfg.data.tokenizer_type = os.path.abspath(os.path.join(dst, ASSETS)), \
            "HuggingFaceTokenizer"
        ids = {k: getattr(hf_config, k, None) for k in SPECIAL_IDS}
        with open(os.path.join(dst, ASSETS, TOKEN_IDS), "w") as fh:
            json.dump({k: v for k, v in ids.items() if v is not None}, fh)

    def values(name, _p):  # fp32, read and converted a chunk at a time
        return megazero_tensor(name, cfg, lambda hf_name: weights.get(hf_name, torch.float32),
                               hf_config.model_type)
    return save_weights(dst, [skeleton], ParallelMesh.single(), cfg, iteration=0,
                        extra={"converted_from": os.path.abspath(src)}, values=values)


def _copy_hf_files(src: str, dst: str) -> bool:
    """Copy the tokenizer files and generation_config.json of ``src``; whether a tokenizer was there."""
    present = [f for f in HF_FILES if os.path.isfile(os.path.join(src, f))]
    if present:
        os.makedirs(dst, exist_ok=True)
    for f in present:
        shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    return any(f in present for f in TOKENIZER_FILES)


def to_hf(src: str, dst: str, iteration: Optional[int] = None, tokenizer: Optional[str] = None,
          dtype: str = "fp32", max_shard_size: str = "5GB") -> str:
    """Checkpoint directory ``src`` -> Hugging Face directory ``dst``; returns a line saying what was
    written.  Without ``iteration``, a checkpoint found damaged while it is read (a block that does not
    match its checksum) is given up, its shards removed, and the previous one exported, as ``--load``
    does."""
    from megazero.checkpoint import CheckpointCorrupt, CheckpointError, open_weights
    from .hf import hf_config_from
    skipped, damaged = [], []
    while True:
        notes: list = []
        try:
            path, meta, saved, get, close = open_weights(src, iteration, flag="--input", notes=notes,
                                                         skip=skipped)
        except CheckpointError as err:
            if not damaged:
                raise
            rest = str(err).split("no usable checkpoint: ", 1)[-1]  # why the older ones failed
            raise CheckpointCorrupt(f"--input {src}: no usable checkpoint: {'; '.join(damaged + [rest])}") \
                from err
        try:
            cfg, files = _write_weights(dst, saved, get, dtype, max_shard_size)
            break
        except CheckpointCorrupt as err:
            if iteration is not None:
                raise
            damaged.append(str(err))
            skipped.append(int(meta["iteration"]))
        finally:
            close()
    hf_config = hf_config_from(cfg)
    hf_config.dtype = str(DTYPES[dtype]).replace("torch.", "")
    hf_config.save_pretrained(dst)
    plural = "s" if len(files) > 1 else ""
    notes = [f"skipped {d}" for d in damaged] + notes
    why = f"; not the newest: {'; '.join(notes)}" if notes else ""
    line = (f"wrote {dst} ({len(files)} safetensors file{plural}, {dtype}) from {path} "
            f"(iteration {meta['iteration']}{why})")
    return line + _tokenizer_and_generation(dst, tokenizer or saved.get("data", {}).get("tokenizer_model"))


def _write_weights(dst: str, saved: dict, get, dtype: str, max_shard_size: str):
    """Stream the checkpoint's parameters (``get(name)``) into safetensors shards in ``dst``; returns
    ``(whole-model config, file names)``.  On an error the shards written so far are removed."""
    from .checkpoint import model_settings
    from .hf import export_groups
    from .safetensors_io import ShardedWriter, parse_size
    cfg = _whole_model_cfg(model_settings(saved))
    groups = export_groups(cfg)
    writer = ShardedWriter(dst, parse_size(max_shard_size), sum(len(hf) for _, hf, _ in groups))
    try:
        for mz_names, hf_names, fn in groups:
            tensors = [get(name) for name in mz_names]
            for hf_name, t in zip(hf_names, fn(*tensors)):
                writer.add(hf_name, t, DTYPES[dtype])
            del tensors
        return cfg, writer.close()
    except BaseException:
        writer.abort()
        raise


def _tokenizer_and_generation(dst: str, tokenizer: Optional[str]) -> str:
    """Export the tokenizer (its special ids into config.json) and write generation_config.json (the
    tokenizer directory's own when it has one); returns what to add to the report line."""
    from transformers import AutoConfig, GenerationConfig
    from .hf import export_tokenizer
    note = ""
    if not tokenizer:
        note = "; no tokenizer (the run had none: pass --tokenizer-model to add one)"
    elif not os.path.exists(tokenizer):
        note = f"; tokenizer {tokenizer} not found from here (pass --tokenizer-model PATH)"
    else:
        try:
            tok = export_tokenizer(tokenizer, dst)
        except ValueError as err:
            note = f"; tokenizer not exported: {err}"
        else:
            config = AutoConfig.from_pretrained(dst)  # the tokenizer's special ids in the model's config,
            ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
            recorded = os.path.join(tokenizer, TOKEN_IDS)  # or those of the model it was converted from
            if os.path.isfile(recorded):
                with open(recorded) as fh:
                    ids.update(json.load(fh))
            for k, v in ids.items():
                setattr(config, k, v)
            config.save_pretrained(dst)
            note = f" with tokenizer {tokenizer} ({type(tok).__name__})"
    own = None
    if tokenizer and os.path.isdir(tokenizer):
        own = os.path.join(tokenizer, "generation_config.json")
    if own and os.path.isfile(own):
        shutil.copy2(own, os.path.join(dst, "generation_config.json"))
    else:
        GenerationConfig.from_model_config(AutoConfig.from_pretrained(dst)).save_pretrained(dst)
    return note + "; generation_config.json"
