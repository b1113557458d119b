"""A megazero checkpoint -> Megatron-LM's ``torch_dist`` format, which megatron-core's
``dist_checkpointing.load`` reads at any tensor-parallel size (one process, no model needed).

Written: ``OUT/latest_checkpointed_iteration.txt``, ``OUT/iter_XXXXXXX/`` with
``torch.distributed.checkpoint`` files (``.metadata``, ``__<rank>_0.distcp``) holding every tensor under
megatron-core's sharded names (a layer's tensors stacked over layers, stored a layer a chunk; norms
under the names both layer specs save, ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight``; the ``_extra_state`` of each linear layer as ``None``, what the local
layer spec keeps: :mod:`~.dcp_plan`), ``common.pt``
(``args``: Megatron-LM's argument names for the architecture, ``iteration``, ``checkpoint_version``,
``opt_param_scheduler`` with the samples the schedule counted) and ``metadata.json``; float32.  With
Adam (fp32 or bf16 weights) the optimizer as megatron-core's non-distributed optimizer saves it
(``optimizer.state.exp_avg.<name>``, ``exp_avg_sq``, ``fp32_param`` for bf16, chunked as the weights;
``common.pt``'s ``optimizer``: torch Adam's parameter groups and the common step); otherwise the
weights only (the args say ``no_save_optim``).  No generator state (``no_save_rng``): Megatron-LM
resumes with ``--no-load-rng``.  ``pretrain_gpt.py --ckpt-format torch_dist`` writes each save this
way (:mod:`~.save`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Optional

import torch

from megazero.checkpoint.errors import CheckpointError


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


def start(path: str) -> str:
    """A fresh ``iter_*.partial`` directory beside ``path`` (one process), returned.  An existing
    ``path`` that is not a Megatron-LM torch_dist checkpoint (megazero's own, say) is never replaced."""
    from megazero.checkpoint.megatron.files import format_of
    if os.path.exists(path) and format_of(path) != "torch_dist":
        raise CheckpointError(f"{path} exists and is not a Megatron-LM torch_dist checkpoint; it is left as "
                              "it is: choose another --save (--output) directory")
    part = path + ".partial"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    return part


def optimizer_common(meta: dict, config: dict, wrapped: bool) -> dict:
    """The optimizer's items megatron-core keeps in ``common.pt`` (its non-distributed optimizer's
    ``sharded_state_dict``): torch Adam's parameter groups as megatron-core makes them (weights with
    weight decay, then biases and norms without) and the common step; ``wrapped`` (bf16) as its
    mixed-precision optimizer nests them."""
    opt = config.get("optimizer", {})
    base = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": opt.get("lr"), "min_lr": opt.get("min_lr"), "lr": opt.get("lr"),
            "betas": (opt.get("adam_beta1", 0.9), opt.get("adam_beta2", 0.999)),
            "eps": opt.get("adam_eps", 1e-8), "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    groups = [dict(base, wd_mult=1.0, weight_decay=opt.get("weight_decay", 0.0)),
              dict(base, wd_mult=0.0, weight_decay=0.0)]
    inner = {"param_groups": groups, "state": {"common_step": torch.tensor(float(meta["optimizer"]["step"]))}}
    return {"optimizer": inner} if wrapped else inner


def finish(part: str, dst: str, meta: dict, config: dict, layout: Optional[dict] = None,
           scheduler: Optional[dict] = None) -> str:
    """``common.pt`` and ``metadata.json`` into ``part`` (its tensors written), renamed to its
    ``iter_*`` name; then the tracker names it (one process).  Returns the ``iter_*`` path."""
    it = int(meta["iteration"])
    extra = meta.get("extra", {})
    consumed = int(extra.get("consumed_samples", 0))
    args = megatron_args(config["model"], it, consumed)
    sizes = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    sizes.update(layout or {})
    for key, value in sizes.items():
        setattr(args, key, value)
    from megazero.checkpoint.megatron.dcp_plan import optimizer_kinds
    kinds = optimizer_kinds(meta, config)
    args.no_save_optim, args.no_save_rng = not kinds, True  # Megatron-LM loads what is there
    args.add_position_embedding = True  # Megatron-LM's default, which its loader compares
    for key in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file"):
        if config.get("data", {}).get(key) is not None:
            setattr(args, key, config["data"][key])
    sched = dict(scheduler or {}, num_steps=int(extra.get("lr_samples", consumed)))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": it, "opt_param_scheduler": sched,
              "num_floating_point_operations_so_far": 0}
    if kinds:
        common["optimizer"] = optimizer_common(meta, config, wrapped=any(k == "fp32_param" for k, _ in kinds))
    torch.save(common, os.path.join(part, "common.pt"))
    with open(os.path.join(part, "metadata.json"), "w") as fh:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, fh)
    path = os.path.join(dst, f"iter_{it:07d}")
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.rename(part, path)
    tracker = os.path.join(dst, "latest_checkpointed_iteration.txt")
    with open(tracker + ".tmp", "w") as fh:
        fh.write(str(it))
    os.replace(tracker + ".tmp", tracker)
    return path


def export(src: str, dst: str, iteration=None, layout: Optional[dict] = None,
           scheduler: Optional[dict] = None) -> str:
    """Write megazero checkpoint ``src`` (its latest, or ``iteration``) into ``dst`` in Megatron-LM's
    torch_dist format (one process, a layer's tensor in memory at a time); returns the ``iter_*``
    path.  ``layout``: the saving run's parallel sizes as Megatron-LM's args name them
    (``tensor_model_parallel_size``, ...; default 1); ``scheduler``: more of Megatron's
    ``opt_param_scheduler`` items (``max_lr``, ``min_lr``, ...).  The directory is written beside its
    final name and renamed, then the tracker names it."""
    from megazero.checkpoint.megatron.dcp_plan import write_tensors
    from megazero.checkpoint.resolve import resolve_here
    from megazero.checkpoint.integrity import read_json
    from megazero.checkpoint.format import CONFIG
    path, meta, _ = resolve_here(src, iteration, flag="--input")
    config = read_json(os.path.join(path, CONFIG))
    _refuse_unmapped(config["model"], config.get("moe", {}))
    it = int(meta["iteration"])
    part = start(os.path.join(dst, f"iter_{it:07d}"))
    meta, config = write_tensors(src, it, part)
    return finish(part, dst, meta, config, layout, scheduler)
