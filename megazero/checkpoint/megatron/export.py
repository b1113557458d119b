"""A megazero checkpoint -> Megatron-LM's ``torch_dist`` format, which megatron-core's
``dist_checkpointing.load`` reads at any tensor-parallel size (one process, no model needed).

Written: ``OUT/latest_checkpointed_iteration.txt``, ``OUT/iter_XXXXXXX/`` with
``torch.distributed.checkpoint`` files (``.metadata``, ``__0_0.distcp``) holding every tensor whole
under megatron-core's sharded names (a layer's tensors stacked over layers; norms under the names
both layer specs save, ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``; the
``_extra_state`` of each linear layer as ``None``, what the local layer spec keeps), ``common.pt``
(``args``: Megatron-LM's argument names for the architecture, ``iteration``, ``checkpoint_version``,
``opt_param_scheduler`` with the samples the schedule counted) and ``metadata.json``.  The weights
only (float32): Megatron-LM resumes it with ``--no-load-optim --no-load-rng`` (or ``--finetune``); the
stored args also say ``no_save_optim`` and ``no_save_rng``.  ``pretrain_gpt.py --ckpt-format torch_dist``
writes each save this way (:mod:`~.save`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Dict, Optional

import torch

from megazero.checkpoint.errors import CheckpointError
from megazero.checkpoint.megatron.mapping import GATED, GLOBAL, LAYER

EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
SAVED_NAME = {"input_norm": "self_attention.linear_qkv.layer_norm_{}",  # megatron-core's sharded names
              "post_attention_norm": "mlp.linear_fc1.layer_norm_{}"}


def megatron_args(model: dict, iteration: int, consumed: int) -> argparse.Namespace:
    """Megatron-LM's argument names for a megazero model section (``config.json``'s ``model``)."""
    m = dict(model)
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    return argparse.Namespace(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=m.get("kv_channels"), seq_length=m["seq_length"],
        max_position_embeddings=m.get("max_position_embeddings") or m["seq_length"],
        position_embedding_type=m["position_embedding_type"], rotary_base=m.get("rotary_base"),
        rotary_percent=m.get("rotary_percent", 1.0), normalization=m["normalization"],
        norm_epsilon=m["norm_epsilon"], swiglu=m["activation"] == "swiglu",
        squared_relu=m["activation"] == "squared_relu", openai_gelu=m["activation"] == "gelu",
        add_bias_linear=m["add_bias_linear"], add_qkv_bias=m.get("add_qkv_bias", False),
        qk_layernorm=m.get("qk_layernorm", False),
        untie_embeddings_and_output_weights=m["untie_embeddings_and_output_weights"],
        vocab_size=m["vocab_size"], padded_vocab_size=m["padded_vocab_size"],
        make_vocab_size_divisible_by=m["make_vocab_size_divisible_by"], hidden_dropout=m["hidden_dropout"],
        attention_dropout=m["attention_dropout"], apply_layernorm_1p=False, iteration=iteration,
        consumed_train_samples=consumed, ckpt_format="torch_dist")


def unmapped(model: dict, moe: dict) -> Optional[str]:
    """Why a model does not map onto megatron-core's GPTModel here (None: it does)."""
    if moe.get("num_experts"):
        return "mixture-of-experts models are not written yet"
    mapped = ("gelu_exact", "gelu", "swiglu", "squared_relu")
    if model.get("norm_position", "pre") != "pre" or model.get("multi_latent_attention") or \
            model.get("hybrid_layer_pattern") or model["activation"] not in mapped:
        return ("only dense pre-norm GPT models (GELU, SwiGLU or squared ReLU) map onto megatron-core's "
                "GPTModel")
    return None


def _refuse_unmapped(model: dict, moe: dict) -> None:
    why = unmapped(model, moe)
    if why:
        raise CheckpointError(f"--direction to-megatron: {why}")


def megatron_tensors(weights: Dict[str, torch.Tensor], model: dict) -> Dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors (stacked over layers) from megazero's full weights."""
    layers, padded = model["num_layers"], model["padded_vocab_size"]
    out: Dict[str, torch.Tensor] = {}
    for name, src in GLOBAL.items():
        if name in weights:
            t = weights[name]
            if name in ("word_embeddings.weight", "output_layer.weight") and t.shape[0] < padded:
                t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
            out[src] = t
    if model["untie_embeddings_and_output_weights"] and "output_layer.weight" not in weights:
        raise CheckpointError("the checkpoint has no output_layer.weight for an untied head")
    per_layer: Dict[str, list] = {}
    for i in range(layers):
        for name, t in weights.items():
            prefix = f"decoder.{i}."
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            leaf, kind = rest.rsplit(".", 1)
            if leaf == "mlp.gate":
                continue
            if leaf == "mlp.fc1":
                target = f"mlp.linear_fc1.{kind}"
                if model["activation"] in GATED:
                    t = torch.cat([weights[f"{prefix}mlp.gate.{kind}"], t])
            elif leaf in SAVED_NAME:
                target = SAVED_NAME[leaf].format(kind)
            elif leaf in LAYER:
                target = LAYER[leaf][0].format(kind)
            else:
                raise CheckpointError(f"--direction to-megatron: {name} has no megatron-core name here")
            per_layer.setdefault("decoder.layers." + target, []).append(t)
    for key, ts in per_layer.items():
        out[key] = torch.stack(ts)
    return {k: v.contiguous() for k, v in out.items()}


def export(src: str, dst: str, iteration=None, layout: Optional[dict] = None,
           scheduler: Optional[dict] = None) -> str:
    """Write megazero checkpoint ``src`` (its latest, or ``iteration``) into ``dst`` in Megatron-LM's
    torch_dist format; returns the ``iter_*`` path.  ``layout``: the saving run's parallel sizes as
    Megatron-LM's args name them (``tensor_model_parallel_size``, ...; default 1); ``scheduler``: more
    of Megatron's ``opt_param_scheduler`` items (``max_lr``, ``min_lr``, ...).  The directory is written
    beside its final name and renamed, then the tracker names it."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from megazero.checkpoint.reader import read_weights
    _, meta, config, weights = read_weights(src, iteration, flag="--input")
    model, moe = config["model"], config.get("moe", {})
    _refuse_unmapped(model, moe)
    it = int(meta["iteration"])
    extra = meta.get("extra", {})
    consumed = int(extra.get("consumed_samples", 0))
    state: Dict[str, object] = dict(megatron_tensors(weights, model))
    del weights
    for leaf in EXTRA_STATE:  # megatron-core's per-layer extra state objects: None for its local layers
        for i in range(model["num_layers"]):  # as megatron-core stores an object: a one-item list
            state[f"decoder.layers.{leaf}._extra_state/shard_{i}_{model['num_layers']}"] = [None]
    path = os.path.join(dst, f"iter_{it:07d}")
    part = path + ".partial"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    save(state, storage_writer=FileSystemWriter(part), no_dist=True)
    args = megatron_args(model, it, consumed)
    sizes = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    sizes.update(layout or {})
    for key, value in sizes.items():
        setattr(args, key, value)
    args.no_save_optim, args.no_save_rng = True, True  # weights only: Megatron-LM loads neither
    args.add_position_embedding = True  # Megatron-LM's default, which its loader compares
    for key in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        if config.get("data", {}).get(key) is not None:
            setattr(args, key, config["data"][key])
    sched = dict(scheduler or {}, num_steps=int(extra.get("lr_samples", consumed)))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": it, "opt_param_scheduler": sched,
              "num_floating_point_operations_so_far": 0}
    torch.save(common, os.path.join(part, "common.pt"))
    with open(os.path.join(part, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, fh)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.rename(part, path)
    tracker = os.path.join(dst, "latest_checkpointed_iteration.txt")
    with open(tracker + ".tmp", "w") as fh:
        fh.write(str(it))
    os.replace(tracker + ".tmp", tracker)
    return path
