"""Loading a checkpoint into any layout: reassemble each parameter over the saved TP shards, keep
this rank's slice, hand the per-parameter state to the optimizer (which keeps its DP/ZeRO slice)."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.format import (ARCH_FIELDS, CONFIG, EMBEDDING, SCHEDULER_FIELDS, CheckpointError, all_ok,
                                        arch_of, latest_iteration, layout_of, named_params, on_rank0,
                                        read_json, resolve_checkpoint, rng_file, rng_trackers)
from megazero.tensor_parallel.layers import pad_rows, shard

RESEED_STRIDE = 1_000_003  # resume seed = seed + RESEED_STRIDE * iteration (layout changed)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resolve_here(directory: str, iteration: Optional[int]) -> Tuple[str, dict]:
    """The checkpoint directory and its metadata, as this process sees the file system."""
    return resolve_checkpoint(directory, iteration)


def _resolve(directory: str, iteration: Optional[int], mesh) -> Tuple[str, dict]:
    """:func:`_resolve_here` on global rank 0, shared with every rank (collective)."""
    return tuple(on_rank0(lambda: _resolve_here(directory, iteration), mesh))


def resume_iteration(load_dir: str, save_dir: Optional[str], mesh, iteration: Optional[int] = None) -> Optional[int]:
    """The iteration ``--load load_dir`` resumes from, or None to start fresh: ``--save`` and
    ``--load`` name the same directory (Megatron's auto-resume pattern) and it holds no checkpoint
    yet.  Decided by global rank 0 and shared with every rank (collective); any other missing or
    incomplete checkpoint raises :class:`CheckpointError` on every rank.  ``iteration``: a given
    one (``--ckpt-step``) instead of the latest."""
    def decide() -> Optional[int]:
        same = save_dir is not None and os.path.realpath(save_dir) == os.path.realpath(load_dir)
        if same and os.path.isdir(load_dir) and latest_iteration(load_dir) is None:
            return None
        if same and not os.path.exists(load_dir):
            return None
        return int(_resolve_here(load_dir, iteration)[1]["iteration"])
    return on_rank0(decide, mesh)


def _state_names(cfg) -> List[str]:
    """The optimizer moments this run's optimizer keeps per parameter."""
    opt = cfg.optimizer
    if opt.optimizer == "adam":
        return ["exp_avg", "exp_avg_sq"]
    return ["momentum_buffer"] if opt.sgd_momentum else []


def _check_compatible(meta: dict, cfg, path: str, load_optim: bool = True) -> str:
    """Refuse what cannot be resharded; return the architecture differences as a hint for errors."""
    saved, mine = meta["model"], arch_of(cfg)
    key = "untie_embeddings_and_output_weights"
    if bool(saved[key]) != bool(mine[key]):
        def kind(untied):
            return "untied (--untie-embeddings-and-output-weights)" if untied else "tied"
        raise CheckpointError(f"{path}: the checkpoint's output head is {kind(saved[key])} but this run's "
                              f"is {kind(mine[key])}; use the same embedding tying as the saving run")
    so, names = meta["optimizer"], _state_names(cfg)
    if load_optim and sorted(so["state_names"]) != sorted(names):
        raise CheckpointError(
            f"{path}: the checkpoint holds optimizer state for --optimizer {so['name']} "
            f"({', '.join(so['state_names']) or 'none'}) but this run uses --optimizer "
            f"{cfg.optimizer.optimizer} ({', '.join(names) or 'none'}); "
            "resume with the same optimizer settings")
    diffs = [f"{_flag(k)} {saved[k]} in the checkpoint, {mine[k]} in this run"
             for k in ARCH_FIELDS if saved.get(k) != mine[k]]
    return "; ".join(diffs)


def _check_scheduler(meta: dict, cfg, path: str) -> None:
    """The learning-rate schedule must match the checkpoint's unless --override-opt-param-scheduler
    (as in Megatron-LM; --train-iters may grow freely)."""
    if cfg.checkpoint.override_opt_param_scheduler:
        return
    saved = meta["scheduler"]
    diffs = []
    for k in SCHEDULER_FIELDS:
        if k in saved and saved[k] != getattr(cfg.optimizer, k):
            note = " (it defaults to --train-iters)" if cfg.is_filled(k) else ""
            diffs.append(f"{_flag(k)} {saved[k]} in the checkpoint, {getattr(cfg.optimizer, k)} in this run{note}")
    if diffs:
        raise CheckpointError(f"{path}: the learning-rate schedule differs from the checkpoint's: "
                              f"{'; '.join(diffs)}. Resume with the checkpoint's values, or pass "
                              "--override-opt-param-scheduler to use this run's")


def _open_model_files(path: str, meta: dict) -> Dict[str, Dict[int, dict]]:
    """``name -> {saved tp rank: entry}`` over every model file (memory-mapped: read on use)."""
    index: Dict[str, Dict[int, dict]] = {}
    for fname in meta["model_files"]:
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            raise CheckpointError(f"{path}: model file {fname} is missing")
        payload = torch.load(fpath, map_location="cpu", weights_only=True, mmap=True)
        for name, entry in payload["params"].items():
            index.setdefault(name, {})[payload["tp_rank"]] = entry
    return index


def _full(entries: Dict[int, dict], key: str, saved_tp: int, vocab: int, name: str,
          path: str) -> torch.Tensor:
    """One state tensor of a parameter, whole: saved TP pieces concatenated, vocab padding removed."""
    first = entries[min(entries)]
    if first["tensor_model_parallel"] and saved_tp > 1:
        missing = [t for t in range(saved_tp) if t not in entries]
        if missing:
            raise CheckpointError(f"{path}: parameter {name} lacks the shards of tensor-parallel ranks "
                                  f"{missing}")
        t = torch.cat([entries[r]["state"][key] for r in range(saved_tp)], dim=first["partition_dim"])
    else:
        t = first["state"][key]
    return t[:vocab] if first["vocab_parallel"] else t


def _expected_full_shape(p, local_shape, mesh, cfg) -> Tuple[int, ...]:
    shape = list(local_shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= mesh.tp_size
    if getattr(p, "vocab_parallel", False):
        shape[0] = cfg.model.vocab_size
    return tuple(shape)


def _local(t: torch.Tensor, p, mesh, cfg) -> torch.Tensor:
    """This rank's slice of a full (unpadded) tensor: vocabulary padded, TP-sharded.  May be a view
    of the memory-mapped file: the optimizer copies it into its own storage."""
    if getattr(p, "vocab_parallel", False):
        t = pad_rows(t, cfg.model.padded_vocab_size)
    if getattr(p, "tensor_model_parallel", False):
        t = shard(t, mesh, p.partition_dim)
    return t


def _read_states(path: str, meta: dict, chunks, shapes, mesh, cfg, hint: str, load_optim: bool = True):
    """Per-parameter states for this rank (``{param: {master, moments..., step}}``); without
    ``load_optim`` the moments start at zero and the step at 0 (a fresh optimizer)."""
    index = _open_model_files(path, meta)
    saved_tp, vocab = meta["layout"]["tp"], meta["model"]["vocab_size"]
    moments = _state_names(cfg)
    step = torch.tensor(int(meta["optimizer"]["step"]) if load_optim else 0)
    suffix = f" (model settings differ: {hint})" if hint else ""
    states, frozen = {}, []
    for name, p in named_params(chunks):
        key = EMBEDDING if getattr(p, "tied_copy", False) else name
        label = name if key == name else f"{name} (tied to {key})"
        if key not in index:
            raise CheckpointError(f"{path}: parameter {label} is not in the checkpoint{suffix}")
        entries = index[key]
        want = _expected_full_shape(p, shapes[id(p)], mesh, cfg)
        master = _full(entries, "master", saved_tp, vocab, label, path)
        if tuple(master.shape) != want:
            raise CheckpointError(f"{path}: parameter {label} has shape {tuple(master.shape)} in the "
                                  f"checkpoint but {want} in this model{suffix}")
        if not p.requires_grad:
            frozen.append((p, _local(master, p, mesh, cfg)))
            continue
        states[p] = {"master": _local(master, p, mesh, cfg), "step": step}
        for k in moments:
            states[p][k] = (_local(_full(entries, k, saved_tp, vocab, label, path), p, mesh, cfg) if load_optim
                            else torch.zeros_like(states[p]["master"]))
    if hint:  # every parameter fit, yet the model differs (e.g. fewer layers): refuse a partial load
        raise CheckpointError(f"{path}: the checkpoint's model differs from this run's: {hint}")
    return states, frozen


def _restore_rng(path: str, meta: dict, chunks, mesh, cfg, allowed: bool = True) -> bool:
    """Restore this rank's generators when ``allowed`` and the layout matches; else reseed from
    (seed, iteration)."""
    def comparable(layout):
        return {k: v for k, v in layout.items() if k != "zero_stage"}
    fpath = os.path.join(path, rng_file(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank))
    trackers = rng_trackers(chunks)
    if allowed and comparable(meta["layout"]) == comparable(layout_of(cfg, mesh)) and os.path.isfile(fpath):
        rng = torch.load(fpath, map_location="cpu", weights_only=True)
        if len(rng["trackers"]) == len(trackers):
            torch.set_rng_state(rng["cpu"])
            if mesh.device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], mesh.device)
            for t, state in zip(trackers, rng["trackers"]):
                t.set_state(state)
            return True
    from megazero.tensor_parallel.random import RNGTracker, seed_default_generators
    seed = cfg.training.seed + RESEED_STRIDE * int(meta["iteration"])
    seed_default_generators(seed, mesh)
    for t in trackers:
        t.set_state(RNGTracker(seed, mesh.tp_rank, mesh.device).get_state())
    return False


def load(directory: str, chunks, optimizer, mesh, cfg, iteration: Optional[int] = None) -> Dict[str, object]:
    """Load the latest checkpoint in ``directory`` (or ``iteration``) into this rank's chunks and
    optimizer, whatever layout wrote it (collective: every rank calls it).

    ``--finetune``: the weights only, then iteration 0 with a fresh optimizer, schedule, data
    position and generators.  ``--no-load-optim`` (or a checkpoint of weights only, such as one
    converted from Hugging Face): a fresh optimizer (zero moments, step 0, this run's loss scale);
    the iteration continues.  ``--no-load-rng``: generators reseeded from (seed, iteration).

    Returns ``iteration``, ``extra`` (as given to :func:`save`; empty with ``--finetune``),
    ``path``, ``layout`` (the saving one), ``rng_restored``, ``optimizer_loaded`` and ``seconds``.
    Raises :class:`CheckpointError` naming the path, the parameter and both shapes, or the
    setting that differs."""
    start = time.perf_counter()
    ck = cfg.checkpoint
    path, meta = _resolve(directory, iteration, mesh)  # decided by rank 0: identical on every rank
    load_optim = not (ck.finetune or ck.no_load_optim or meta.get("weights_only", False))
    hint = _check_compatible(meta, cfg, path, load_optim)
    if load_optim:
        _check_scheduler(meta, cfg, path)
    bucketed = optimizer.param_shapes()  # ZeRO-3 shards its parameters: full shapes from the buckets
    shapes = {id(p): tuple(bucketed.get(p, p.shape)) for _, p in named_params(chunks)}
    error, states, frozen = None, {}, []
    try:
        states, frozen = _read_states(path, meta, chunks, shapes, mesh, cfg, hint, load_optim)
    except Exception as err:  # noqa: BLE001 - every rank must stop before the collectives below
        error = err
    ok = all_ok(error is None, mesh)
    if error is not None:
        raise error if isinstance(error, CheckpointError) else CheckpointError(
            f"{path}: {type(error).__name__}: {error}") from error
    if not ok:
        raise CheckpointError(f"{path}: loading failed on another rank (see its error)")
    optimizer.load_param_states(states)  # keeps this rank's DP/ZeRO slice; parameters follow
    with torch.no_grad():
        for p, t in frozen:
            p.copy_(t)
    if load_optim:
        so = meta["optimizer"]
        optimizer.step_count = int(so["step"])
        optimizer.skipped_steps = int(so["skipped_steps"])
        optimizer.scaler.load_state_dict(so["scaler"])
    it = 0 if ck.finetune else int(meta["iteration"])
    restored = False
    if not ck.finetune:  # a fine-tuning run keeps the generators of its own start-up
        restored = _restore_rng(path, meta, chunks, mesh, cfg, allowed=not ck.no_load_rng)
    return {"iteration": it, "extra": {} if ck.finetune else meta.get("extra", {}), "path": path,
            "saved_iteration": int(meta["iteration"]), "layout": meta["layout"], "rng_restored": restored,
            "optimizer_loaded": load_optim, "seconds": time.perf_counter() - start}


def read_weights(directory: str, iteration: Optional[int] = None,
                 flag: str = "--load") -> Tuple[str, dict, dict, Dict[str, torch.Tensor]]:
    """One process, no model needed: ``(path, metadata, config, weights)`` of the latest checkpoint
    in ``directory`` (or ``iteration``), saved under any layout.  ``config`` is the saving run's
    whole configuration (``config.json``, a dict); ``weights`` maps every parameter's global name to
    its full fp32 master weight (TP shards joined, vocabulary unpadded; a tied output head is
    ``word_embeddings.weight``).  ``flag``: how the user named the directory (for errors)."""
    path, meta = resolve_checkpoint(directory, iteration, flag)
    index = _open_model_files(path, meta)
    saved_tp, vocab = meta["layout"]["tp"], meta["model"]["vocab_size"]
    weights = {name: _full(entries, "master", saved_tp, vocab, name, path).clone()
               for name, entries in sorted(index.items())}
    return path, meta, read_json(os.path.join(path, CONFIG)), weights
