"""Loading a checkpoint into any layout.

Format v2 (per-rank data shards, :mod:`megazero.checkpoint.assemble`): each rank reads only the byte
ranges of its new slice.  Format v1 (one torch file per (tp, pp) shard): reassemble each parameter
over the saved TP shards, keep this rank's slice, hand the per-parameter state to the optimizer
(which keeps its DP/ZeRO slice).  Either way a corrupt newest checkpoint makes :func:`load` fall
back to the previous complete one (:mod:`megazero.checkpoint.resolve`)."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Tuple

import torch

from megazero.checkpoint.assemble import check_params, load_rank_state, verify_rank_state
from megazero.checkpoint.format import (ARCH_FIELDS, EMBEDDING, FORMAT_V1, SCHEDULER_FIELDS, CheckpointError,
                                        agree, all_ok, arch_of, latest_iteration, layout_of, named_params,
                                        on_rank0, rng_file, rng_trackers)
from megazero.checkpoint.integrity import CheckpointCorrupt, check_file
from megazero.checkpoint.resolve import complete_iterations, resolve, resolve_here
from megazero.checkpoint.shards import SavedShards
from megazero.tensor_parallel.layers import pad_rows, shard

RESEED_STRIDE = 1_000_003  # resume seed = seed + RESEED_STRIDE * iteration (layout changed)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resume_iteration(load_dir: str, save_dir: Optional[str], mesh) -> Optional[int]:
    """The iteration ``--load load_dir`` resumes from, or None to start fresh: ``--save`` and
    ``--load`` name the same directory (Megatron's auto-resume pattern) and it holds no checkpoint
    yet.  Decided by global rank 0 and shared with every rank (collective); any other missing or
    incomplete checkpoint raises :class:`CheckpointError` on every rank."""
    def decide() -> Optional[int]:
        same = save_dir is not None and os.path.realpath(save_dir) == os.path.realpath(load_dir)
        if same and not os.path.exists(load_dir):
            return None
        if same and os.path.isdir(load_dir) and not complete_iterations(load_dir):
            try:
                if latest_iteration(load_dir) is None:
                    return None
            except CheckpointError:
                pass  # a garbled tracker: resolve_here explains
        return int(resolve_here(load_dir, None)[1]["iteration"])
    return on_rank0(decide, mesh)


def _state_names(cfg) -> List[str]:
    """The optimizer moments this run's optimizer keeps per parameter."""
    opt = cfg.optimizer
    if opt.optimizer == "adam":
        return ["exp_avg", "exp_avg_sq"]
    return ["momentum_buffer"] if opt.sgd_momentum else []


def _check_compatible(meta: dict, cfg, path: str) -> str:
    """Refuse what cannot be resharded; return the architecture differences as a hint for errors."""
    saved, mine = meta["model"], arch_of(cfg)
    key = "untie_embeddings_and_output_weights"
    if bool(saved[key]) != bool(mine[key]):
        def kind(untied):
            return "untied (--untie-embeddings-and-output-weights)" if untied else "tied"
        raise CheckpointError(f"{path}: the checkpoint's output head is {kind(saved[key])} but this run's "
                              f"is {kind(mine[key])}; use the same embedding tying as the saving run")
    so, names = meta["optimizer"], _state_names(cfg)
    if sorted(so["state_names"]) != sorted(names):
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


def _read_states(path: str, meta: dict, chunks, shapes, mesh, cfg, hint: str):
    """Per-parameter states for this rank (``{param: {master, moments..., step}}``)."""
    index = _open_model_files(path, meta)
    saved_tp, vocab = meta["layout"]["tp"], meta["model"]["vocab_size"]
    moments = _state_names(cfg)
    step = torch.tensor(int(meta["optimizer"]["step"]))
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
            states[p][k] = _local(_full(entries, k, saved_tp, vocab, label, path), p, mesh, cfg)
    if hint:  # every parameter fit, yet the model differs (e.g. fewer layers): refuse a partial load
        raise CheckpointError(f"{path}: the checkpoint's model differs from this run's: {hint}")
    return states, frozen


def _read_rng(path: str, meta: dict, chunks, mesh, cfg) -> Optional[dict]:
    """This rank's saved generator states when the layout is unchanged (checked against the recorded
    size and checksum; a missing or damaged file is an error), else None."""
    def comparable(layout):
        return {k: v for k, v in layout.items() if k != "zero_stage"}
    if comparable(meta["layout"]) != comparable(layout_of(cfg, mesh)):
        return None
    name = rng_file(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank)
    files = meta.get("files")
    if files is not None and name not in files:
        raise CheckpointCorrupt(f"{path}: {name} is not in the checkpoint's file list")
    fpath = check_file(path, name, files[name]) if files is not None else os.path.join(path, name)
    if files is None and not os.path.isfile(fpath):
        return None  # a v1 checkpoint without this rank's file: reseed
    try:
        rng = torch.load(fpath, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged file is named, never a bare zip error
        raise CheckpointCorrupt(f"{fpath}: unreadable ({type(err).__name__}: {err})") from None
    return rng if len(rng.get("trackers", [])) == len(rng_trackers(chunks)) else None


def _restore_rng(rng: Optional[dict], meta: dict, chunks, mesh, cfg) -> bool:
    """Restore the generators from ``rng`` when every rank has its state (agreed, collective); else
    reseed every rank deterministically from (seed, iteration).  Returns whether they were restored."""
    trackers = rng_trackers(chunks)
    if all_ok(rng is not None, mesh):
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


def _read(path: str, meta: dict, chunks, optimizer, mesh, cfg, hint: str):
    """Everything this rank needs from the checkpoint, read and verified, nothing committed yet:
    ``(apply, rng)`` where ``apply()`` commits the model and optimizer state (collective)."""
    if meta["format"] == FORMAT_V1:
        bucketed = optimizer.param_shapes()  # ZeRO-3 shards its parameters: full shapes from the buckets
        shapes = {id(p): tuple(bucketed.get(p, p.shape)) for _, p in named_params(chunks)}
        states, frozen = _read_states(path, meta, chunks, shapes, mesh, cfg, hint)

        def apply() -> None:
            optimizer.load_param_states(states)  # keeps this rank's DP/ZeRO slice; parameters follow
            with torch.no_grad():
                for p, t in frozen:
                    p.copy_(t)
        return apply, _read_rng(path, meta, chunks, mesh, cfg)
    check_params(meta, chunks, optimizer, mesh, cfg, path, hint)
    keys = ["master"] + _state_names(cfg)
    src = SavedShards(path, meta)
    try:
        verify_rank_state(src, chunks, optimizer, mesh, keys)
        rng = _read_rng(path, meta, chunks, mesh, cfg)
    except BaseException:
        src.close()
        raise

    def apply() -> None:
        try:
            load_rank_state(src, chunks, optimizer, mesh, keys)
        finally:
            src.close()
    apply.discard = src.close  # another rank failed: nothing is applied
    return apply, rng


def _load_one(path: str, meta: dict, chunks, optimizer, mesh, cfg) -> Dict[str, object]:
    hint = _check_compatible(meta, cfg, path)
    _check_scheduler(meta, cfg, path)
    error, apply, rng = None, None, None
    try:
        apply, rng = _read(path, meta, chunks, optimizer, mesh, cfg, hint)  # read and verified, not applied
    except Exception as err:  # noqa: BLE001 - every rank must stop before the collectives below
        error = err
    try:
        agree(error, mesh, "")  # the same error on every rank; a corrupt file lets load() fall back
    except CheckpointError:
        getattr(apply, "discard", lambda: None)()
        raise
    apply()
    so = meta["optimizer"]
    optimizer.step_count = int(so["step"])
    optimizer.skipped_steps = int(so["skipped_steps"])
    optimizer.scaler.load_state_dict(so["scaler"])
    restored = _restore_rng(rng, meta, chunks, mesh, cfg)
    return {"iteration": int(meta["iteration"]), "extra": meta.get("extra", {}), "path": path,
            "layout": meta["layout"], "rng_restored": restored}


def load(directory: str, chunks, optimizer, mesh, cfg, iteration: Optional[int] = None) -> Dict[str, object]:
    """Load the latest checkpoint in ``directory`` (or ``iteration``) into this rank's chunks and
    optimizer, whatever layout wrote it (collective: every rank calls it).

    Without ``iteration``, a newest checkpoint that is incomplete or corrupt (a file missing,
    truncated or altered: sizes and checksums are recorded) is skipped for the previous complete
    one, with a warning in ``warnings``.  Returns ``iteration``, ``extra`` (as given to :func:`save`),
    ``path``, ``layout`` (the saving one), ``rng_restored``, ``seconds`` and ``warnings``.  Raises
    :class:`CheckpointError` naming the path, the file or parameter and both shapes, or the setting
    that differs."""
    start = time.perf_counter()
    skipped: List[int] = []
    warnings: List[str] = []
    while True:
        path, meta, notes = resolve(directory, iteration, mesh, skipped)  # decided by rank 0
        warnings += notes
        try:
            info = _load_one(path, meta, chunks, optimizer, mesh, cfg)
            break
        except CheckpointCorrupt as err:
            if iteration is not None:
                raise
            warnings.append(f"{err}; falling back to the previous checkpoint")
            skipped.append(int(meta["iteration"]))
    info.update(seconds=time.perf_counter() - start, warnings=warnings)
    return info
