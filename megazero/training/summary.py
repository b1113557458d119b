"""The start-up summary rank 0 prints before training, as Megatron-LM's: parameters in total and per
rank, the settings (all of them written to ``--save``/``megazero_config.json``), the data (documents,
tokens, epochs at this schedule) and the tokenizer.

Functions of the resolved config, the built model and the data source; the one collective,
:func:`stage_counts`, gathers each pipeline stage's parameter count over the pipeline group.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from typing import Dict, List, Optional, Sequence

CONFIG_FILE = "megazero_config.json"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(int(n))


def stage_counts(chunks, mesh) -> List[int]:
    """Parameters of this rank's chunks and of its peers' in the other pipeline stages (the same TP
    and DP coordinates), stage by stage: counted on the built model (whole shapes, also where ZeRO-3
    keeps a shard) and gathered over the pipeline group."""
    from megazero.zero.buckets import full_shape
    seen, mine = set(), 0
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                mine += math.prod(full_shape(p))
    if mesh.size("pp") == 1:
        return [mine]
    import torch
    import torch.distributed as dist
    count = torch.tensor([mine], dtype=torch.int64, device=mesh.collective_device)
    out = [torch.empty_like(count) for _ in range(mesh.size("pp"))]
    dist.all_gather(out, count, group=mesh.group("pp"))  # on the mesh's device, whatever the backend
    return [int(c.item()) for c in out]


def provider_stage_counts(cfg, model_provider) -> List[int]:
    """:func:`stage_counts` without process groups: each stage's chunks built by ``model_provider`` on
    the meta device (:func:`megazero.planning.model_state.provider_params`), for a dry run."""
    from megazero.planning.model_state import provider_params
    return [sum(p.numel for c in provider_params(cfg, pp, model_provider) for p in c)
            for pp in range(cfg.parallel.pipeline_model_parallel_size)]


def parameter_line(cfg, per_stage: Sequence[int]) -> str:
    """Parameters of the model and of one rank of each pipeline stage (``per_stage``:
    :func:`stage_counts`)."""
    from megazero.planning.estimate import total_params
    par = cfg.parallel
    zero3 = ""
    if par.zero_stage == 3 and par.data_parallel_size > 1:
        zero3 = f", / {par.data_parallel_size} under ZeRO-3"
    ranks = ", ".join(f"stage {pp}: {_count(n)}" for pp, n in enumerate(per_stage))
    total = total_params(cfg)
    moe = cfg.moe
    active = ""
    if moe.num_experts:  # a mixture of experts: what one token goes through
        n = total_params(cfg, active=True)
        active = (f", {_count(n)} active ({n:,}: {moe.moe_router_topk} of {moe.num_experts} experts per MoE "
                  "layer)")
        if moe.expert_model_parallel_size > 1:
            zero3 += f"; experts / {moe.expert_model_parallel_size} over expert parallelism"
    return (f"parameters: {_count(total)} in total ({total:,}; tied embedding counted "
            f"once, vocabulary unpadded){active}; per rank (one of {par.tensor_model_parallel_size} "
            f"tensor-parallel shards{zero3}): {ranks}")


def non_default_settings(cfg) -> Dict[str, object]:
    """``{flag: value}`` of the settings that differ from their field defaults (derived ones left out)."""
    from megazero.config import SECTIONS, flag_of
    out: Dict[str, object] = {}
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        for f in fields(cls):
            value = getattr(section, f.name)
            if f.metadata.get("derived") or cfg.is_filled(f.name):
                continue
            default = f.default_factory() if callable(getattr(f, "default_factory", None)) else f.default
            if value != default:
                out[flag_of(f)] = value
    return out


def settings_line(cfg, written: Optional[str]) -> str:
    shown = " ".join(f"{flag} {_value(v)}" if v is not True else flag
                     for flag, v in non_default_settings(cfg).items() if v is not False)
    where = f"all settings in {written}" if written else f"all settings go to --save DIR/{CONFIG_FILE}"
    return f"settings other than the defaults: {shown or '(none)'}; {where}"


def _value(v) -> str:
    return " ".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)


def training_samples(cfg) -> int:
    from megazero.config.batch_schedule import consumed_after, schedule_of
    tr = cfg.training
    return consumed_after(schedule_of(tr, cfg.model.seq_length, tr.global_batch_size), tr.train_iters)


def data_lines(cfg, data) -> List[str]:
    """The datasets: documents and tokens, the training split's samples per epoch, and the epochs this
    run's schedule takes of each."""
    samples, tokens = training_samples(cfg), training_samples(cfg) * cfg.model.seq_length
    head = f"data: {cfg.training.train_iters} iterations take {samples:,} samples ({_count(tokens)} tokens)"
    if cfg.data.mock_data:
        return [f"{head} of mock data (synthetic ids below --vocab-size {cfg.model.vocab_size})"]
    lines = [head + ":"]
    for source, split in _sources(data):
        if hasattr(source, "summary_lines"):  # --sft: conversations and their packing (data/sft.py)
            lines += source.summary_lines(split, samples)
            continue
        weights = getattr(source, "weights", [1.0])
        total = sum(weights) or 1.0
        for weight, ds in zip(weights, getattr(source, "datasets", [])):
            n_docs, n_tokens = ds.indexed.num_documents, ds.indexed.num_tokens
            docs = ds.documents(split)
            line = (f"  {ds.prefix}: {n_docs:,} documents, {_count(n_tokens)} tokens; {split} split: "
                    f"{len(docs):,} documents")
            if weight > 0:
                per_epoch = ds.num_samples_per_epoch(split)
                wanted = samples * weight / total
                line += (f", {per_epoch:,} samples per epoch; weight {weight / total:.3g}: "
                         f"{wanted / per_epoch:.3g} epochs at this schedule")
            lines.append(line)
    return lines


def _sources(data):
    """(source, split) pairs of the training data (``--data-path`` or ``--train-data-path``)."""
    if hasattr(data, "sources"):
        return [(data.sources["train"], "train")]
    return [(data, "train")]


def tokenizer_line(cfg) -> str:
    d, m = cfg.data, cfg.model
    padded = (f"padded to {m.padded_vocab_size} (--make-vocab-size-divisible-by "
              f"{m.make_vocab_size_divisible_by} x TP {cfg.parallel.tensor_model_parallel_size})")
    if d.tokenizer_model or d.vocab_file or d.tokenizer_type:
        kind = d.tokenizer_type or ("GPT2BPETokenizer" if d.vocab_file else "from --tokenizer-model")
        source = d.tokenizer_model or d.vocab_file or ""
        return f"tokenizer: {kind} {source}".rstrip() + f"; vocabulary {m.vocab_size}, {padded}"
    return f"tokenizer: none; ids are below --vocab-size {m.vocab_size}, {padded}"


def write_config(cfg, directory: str) -> str:
    """Write the resolved config as JSON to ``directory``/``megazero_config.json``; returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CONFIG_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(cfg.to_dict(), fh, indent=1, sort_keys=True, default=str)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def context_parallel_line(cfg) -> Optional[str]:
    """How the sequence is split over the CP group (None without context parallelism)."""
    par, s = cfg.parallel, cfg.model.seq_length
    cp = par.context_parallel_size
    if cp == 1:
        return None
    chunks = 2 * cp
    attention = "ring attention (p2p)" if par.cp_comm_type == "p2p" else "Ulysses all-to-all (a2a)"
    return (f"context parallel: CP {cp} | --seq-length {s} in {chunks} chunks of {s // chunks} tokens; CP "
            f"rank i holds chunks i and {chunks - 1}-i ({s // cp} tokens per rank) | {attention}")


def startup_summary(cfg, data, per_stage: Sequence[int], rank: int = 0) -> List[str]:
    """The summary lines; rank 0 also writes the config to ``--save`` (when given)."""
    written = write_config(cfg, cfg.checkpoint.save) if rank == 0 and cfg.checkpoint.save else None
    cp = context_parallel_line(cfg)
    return [parameter_line(cfg, per_stage), settings_line(cfg, written), *([cp] if cp else []),
            *data_lines(cfg, data),
            tokenizer_line(cfg)]
