"""Loading a checkpoint into any layout.

Each rank reads only the byte ranges of its new slice from the per-rank data shards
(:mod:`megazero.checkpoint.assemble`).  A corrupt newest checkpoint makes :func:`load` fall
back to the previous complete one (:mod:`megazero.checkpoint.resolve`) unless an iteration was asked
for (``--ckpt-step``).

Loading options (the config's checkpoint section): ``--finetune`` and ``--no-load-optim`` (and a
weights-only checkpoint, e.g. one converted from Hugging Face by :func:`save_weights`) read only
the ``master`` weights and keep a fresh optimizer; ``--finetune`` also starts at iteration 0 with
the generators of this run's start-up; ``--no-load-rng`` reseeds instead of restoring.
:func:`read_weights` reads every full weight in one process, without a model."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megazero.checkpoint.assemble import check_params, load_rank_state, verify_rank_state
from megazero.checkpoint.comm import agree, all_ok, on_rank0
from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError
from megazero.checkpoint.format import (ARCH_FIELDS, CONFIG, MOE_ARCH_FIELDS, SCHEDULER_FIELDS, arch_of,
                                        layout_of, rng_file, rng_trackers)
from megazero.checkpoint.integrity import check_file, read_json
from megazero.checkpoint.resolve import (complete_iterations, describe_foreign, latest_iteration, resolve,
                                         resolve_here)
from megazero.checkpoint.shards import SavedShards, full_shape
from megazero.tensor_parallel.rng import RNGTracker, seed_default_generators

RESEED_STRIDE = 1_000_003  # resume seed = seed + RESEED_STRIDE * iteration (layout changed)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resume_iteration(load_dir: str, mesh, iteration: Optional[int] = None) -> Optional[int]:
    """The iteration ``--load load_dir`` resumes from, or None to start fresh: the directory holds no
    checkpoint yet (:func:`holds_no_checkpoint`), as Megatron-LM starts from random then (the caller
    says so, or refuses with ``--exit-on-missing-checkpoint``).  Decided by global rank 0 and shared
    with every rank (collective); a damaged checkpoint that has no usable predecessor, a directory in
    another format, or a missing ``iteration`` (``--ckpt-step``, asked for instead of the latest)
    raises :class:`CheckpointError` on every rank."""
    def decide() -> Optional[int]:
        if iteration is None and holds_no_checkpoint(load_dir):
            return None
        return int(resolve_here(load_dir, iteration)[1]["iteration"])
    return on_rank0(decide, mesh)


def holds_no_checkpoint(directory: str) -> bool:
    """Whether ``directory`` does not exist, or holds neither a tracker file nor a complete checkpoint
    nor a model in another format (it may hold incomplete saves)."""
    if not os.path.exists(directory):
        return True
    if not os.path.isdir(directory) or complete_iterations(directory):
        return False
    try:
        if latest_iteration(directory) is not None:
            return False
    except CheckpointError:
        return False  # a garbled tracker: resolve_here explains
    return describe_foreign(directory) is None


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
    diffs = [f"{_flag(k)} {saved[k]} in the checkpoint, {mine.get(k)} in this run"
             for k in ARCH_FIELDS + MOE_ARCH_FIELDS
             if k in saved and saved[k] != mine.get(k)]  # older ones lack newer fields
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
            mine = getattr(cfg.optimizer, k)
            diffs.append(f"{_flag(k)} {saved[k]} in the checkpoint, {mine} in this run{note}")
    if diffs:
        raise CheckpointError(f"{path}: the learning-rate schedule differs from the checkpoint's: "
                              f"{'; '.join(diffs)}. Resume with the checkpoint's values, or pass "
                              "--override-opt-param-scheduler to use this run's")


def _read_rng(path: str, meta: dict, chunks, mesh, cfg) -> Optional[dict]:
    """This rank's saved generator states when the layout is unchanged (checked against the recorded
    size and checksum; a missing or damaged file is an error), else None."""
    def comparable(layout):
        return {k: v for k, v in layout.items() if k != "zero_stage"}
    if comparable(meta["layout"]) != comparable(layout_of(cfg, mesh)):
        return None
    name = rng_file(mesh.coord("tp"), mesh.coord("pp"), mesh.coord("dp", "cp"))
    if name not in meta["files"]:
        raise CheckpointCorrupt(f"{path}: {name} is not in the checkpoint's file list")
    fpath = check_file(path, name, meta["files"][name])
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
    seed = cfg.training.seed + RESEED_STRIDE * int(meta["iteration"])
    seed_default_generators(seed, mesh)
    for t in trackers:
        t.set_state(RNGTracker(seed, mesh.coord("tp"), mesh.device).get_state())
    return False


def _fresh_optimizer_state(optimizer) -> None:
    """Zero moments and step 0: the optimizer starts afresh from the loaded weights."""
    optimizer.update.zero_state()
    optimizer.step_count, optimizer.skipped_steps = 0, 0


def _read(path: str, meta: dict, chunks, optimizer, mesh, cfg, hint: str, load_optim: bool, load_rng: bool):
    """Everything this rank needs from the checkpoint, read and verified, nothing committed yet:
    ``(apply, rng)`` where ``apply()`` commits the model and optimizer state (collective).  Without
    ``load_optim`` only the master weights are read; without ``load_rng`` no RNG file is read."""
    check_params(meta, chunks, optimizer, mesh, cfg, path, hint)
    keys = ["master"] + (_state_names(cfg) if load_optim else [])
    src = SavedShards(path, meta)
    try:
        verify_rank_state(src, chunks, optimizer, mesh, keys)
        rng = _read_rng(path, meta, chunks, mesh, cfg) if load_rng else None
    except BaseException:
        src.close()
        raise

    def apply() -> None:
        try:
            if not load_optim:
                _fresh_optimizer_state(optimizer)
            load_rank_state(src, chunks, optimizer, mesh, keys)
        finally:
            src.close()
    apply.discard = src.close  # another rank failed: nothing is applied
    return apply, rng


def _load_one(path: str, meta: dict, chunks, optimizer, mesh, cfg) -> Dict[str, object]:
    ck = cfg.checkpoint
    weights_only = bool(meta.get("weights_only", False))
    load_optim = not (ck.finetune or ck.no_load_optim or weights_only)
    load_rng = not (ck.finetune or ck.no_load_rng or weights_only)
    hint = _check_compatible(meta, cfg, path, load_optim)
    if load_optim:
        _check_scheduler(meta, cfg, path)
    error, apply, rng = None, None, None
    try:  # read and verified, not applied
        apply, rng = _read(path, meta, chunks, optimizer, mesh, cfg, hint, load_optim, load_rng)
    except Exception as err:  # noqa: BLE001 - every rank must stop before the collectives below
        error = err
    try:
        agree(error, mesh, "")  # the same error on every rank; a corrupt file lets load() fall back
    except CheckpointError:
        getattr(apply, "discard", lambda: None)()
        raise
    apply()
    if load_optim:
        so = meta["optimizer"]
        optimizer.step_count = int(so["step"])
        optimizer.skipped_steps = int(so["skipped_steps"])
        optimizer.scaler.load_state_dict(so["scaler"])
    restored = False
    if not ck.finetune:  # a fine-tuning run keeps the generators of its own start-up
        restored = _restore_rng(rng, meta, chunks, mesh, cfg)  # reseeded from (seed, iteration) without rng
    return {"iteration": 0 if ck.finetune else int(meta["iteration"]),
            "extra": {} if ck.finetune else meta.get("extra", {}), "path": path,
            "saved_iteration": int(meta["iteration"]), "layout": meta["layout"], "rng_restored": restored,
            "optimizer_loaded": load_optim}


def load(directory: str, chunks, optimizer, mesh, cfg, iteration: Optional[int] = None) -> Dict[str, object]:
    """Load the latest checkpoint in ``directory`` (or ``iteration``) into this rank's chunks and
    optimizer, whatever layout wrote it (collective: every rank calls it).

    Without ``iteration``, a newest checkpoint that is incomplete or corrupt (a file missing,
    truncated or altered: sizes and checksums are recorded) is skipped for the previous complete
    one, with a warning in ``warnings``; a given ``iteration`` (``--ckpt-step``) is that one or an
    error.

    ``--finetune``: the weights only, then iteration 0 with a fresh optimizer, schedule, data
    position and generators.  ``--no-load-optim`` (or a checkpoint of weights only, such as one
    converted from Hugging Face): a fresh optimizer (zero moments, step 0, this run's loss scale);
    the iteration continues.  ``--no-load-rng``: generators reseeded from (seed, iteration).

    Returns ``iteration``, ``extra`` (as given to :func:`save`; empty with ``--finetune``),
    ``path``, ``saved_iteration``, ``layout`` (the saving one), ``rng_restored``,
    ``optimizer_loaded``, ``seconds`` and ``warnings``.  Raises
    :class:`CheckpointError` naming the path, the file or parameter and both shapes, or the setting
    that differs."""
    start = time.perf_counter()
    skipped: List[int] = []
    warnings: List[str] = []
    damaged: List[str] = []
    while True:
        try:
            path, meta, notes = resolve(directory, iteration, mesh, skipped)  # decided by rank 0
        except CheckpointError as err:
            if not damaged:
                raise
            raise CheckpointCorrupt(f"--load {directory}: no usable checkpoint; each one failed: "
                                    + "; ".join(damaged + [str(err).split(": no usable checkpoint: ")[-1]])
                                    ) from None
        warnings += notes
        try:
            info = _load_one(path, meta, chunks, optimizer, mesh, cfg)
            break
        except CheckpointCorrupt as err:
            if iteration is not None:
                raise
            warnings.append(f"{err}; falling back to the previous checkpoint")
            damaged.append(f"iteration {int(meta['iteration'])}: {err}")
            skipped.append(int(meta["iteration"]))
    info.update(seconds=time.perf_counter() - start, warnings=warnings)
    return info


def _full_weight(src: SavedShards, name: str, vocab: int) -> torch.Tensor:
    """One parameter's whole fp32 master weight: saved TP pieces joined, vocabulary
    padding removed (every block read is checked against its CRC-32)."""
    info = src.params[name]
    shape = [int(s) for s in info["shape"]]
    pieces = []
    for t in range(src.parts(name)):
        out = np.empty(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
        src.read(t, name, "master", 0, out)
        pieces.append(torch.from_numpy(out).view(shape))
    full = torch.cat(pieces, dim=info["dim"]) if len(pieces) > 1 else pieces[0]
    return full[:vocab].clone() if info["vocab_parallel"] else full


def _read_weights_at(path: str, meta: dict) -> Dict[str, torch.Tensor]:
    vocab = meta["model"]["vocab_size"]
    src = SavedShards(path, meta)
    try:
        return {name: _full_weight(src, name, vocab) for name in sorted(meta["params"])}
    finally:
        src.close()


def _read_full_streaming(src: SavedShards, name: str, vocab: int) -> torch.Tensor:
    """One parameter's whole fp32 master weight from v2 shards, assembled in one tensor of its own (a
    TP piece at a time; the mapped pages are released after each piece)."""
    info = src.params[name]
    tp = src.parts(name)
    shape = list(full_shape(info, tp, vocab if info["vocab_parallel"] else None))
    out = torch.empty(shape, dtype=torch.float32)
    local = [int(x) for x in info["shape"]]
    dim = info["dim"] if info["split"] else 0
    for t in range(tp):
        first = t * local[dim]
        take = max(0, min(local[dim], shape[dim] - first))  # the padded vocabulary's tail is skipped
        if take == 0:
            continue
        if dim == 0:
            _read_chunked(src, t, name, out.narrow(0, first, take).reshape(-1).numpy())
        else:  # split along columns: read the piece whole, then place it
            piece = np.empty(int(np.prod(local, dtype=np.int64)), dtype=np.float32)
            _read_chunked(src, t, name, piece)
            out.narrow(dim, first, take).copy_(torch.from_numpy(piece).view(local))
    return out


STREAM_ELEMENTS = 1 << 22  # read at most this many values (16 MiB) through the memory map at once


def _read_chunked(src: SavedShards, tp: int, name: str, dest: np.ndarray) -> None:
    """``dest`` = the first ``dest.size`` master values of TP piece ``tp`` of ``name``, read in bounded
    pieces whose mapped pages are released after each (so only ``dest`` stays resident)."""
    for lo in range(0, dest.size, STREAM_ELEMENTS):
        src.read(tp, name, "master", lo, dest[lo:lo + STREAM_ELEMENTS])
        src.release()


def open_weights(directory: str, iteration: Optional[int] = None, flag: str = "--load",
                 notes: Optional[List[str]] = None, skip: Sequence[int] = ()):
    """``(path, metadata, config, get, close)`` of a checkpoint whose weights are read one parameter at
    a time: ``get(name)`` returns its full fp32 master weight (TP shards joined, vocabulary unpadded) in
    memory of its own, each block checked against its CRC-32 as it is read; ``close()`` when done.
    For an export that must not hold the whole model (:func:`read_weights` reads all at once).
    ``notes``: a list that receives why the checkpoint taken is not the newest, if it is not; ``skip``:
    iterations not to take (a caller that met a damaged block in one falls back past it, as
    :func:`read_weights` does)."""
    path, meta, found = resolve_here(directory, iteration, skip, flag=flag)
    if notes is not None:
        notes.extend(found)
    config = read_json(os.path.join(path, CONFIG))
    vocab = meta["model"]["vocab_size"]
    src = SavedShards(path, meta)
    return path, meta, config, lambda name: _read_full_streaming(src, name, vocab), src.close


def read_weights(directory: str, iteration: Optional[int] = None, flag: str = "--load",
                 notes: Optional[List[str]] = None) -> Tuple[str, dict, dict, Dict[str, torch.Tensor]]:
    """One process, no model needed: ``(path, metadata, config, weights)`` of the latest usable
    checkpoint in ``directory`` (or ``iteration``), saved under any layout, its sizes and checksums
    verified (without ``iteration`` a corrupt newest one falls back to the previous, as
    :func:`load`).  ``config`` is the saving run's whole configuration (``config.json``, a dict);
    ``weights`` maps every parameter's global name to its full fp32 master weight (TP shards joined,
    vocabulary unpadded; a tied output head is ``word_embeddings.weight``).  ``flag``: how the user
    named the directory (for errors); ``notes``: a list that receives why the checkpoint taken is not
    the newest, if it is not."""
    skipped: List[int] = []
    damaged: List[str] = []
    while True:
        try:
            path, meta, found = resolve_here(directory, iteration, skipped, flag=flag)
        except CheckpointError as err:
            if not damaged:
                raise
            tried = "; ".join(damaged)
            raise CheckpointCorrupt(f"{flag} {directory}: no usable checkpoint: {tried}") from err
        try:
            out = path, meta, read_json(os.path.join(path, CONFIG)), _read_weights_at(path, meta)
            if notes is not None:
                notes.extend([f"skipped {d}" for d in damaged] + found)
            return out
        except CheckpointCorrupt as err:
            if iteration is not None:
                raise
            damaged.append(str(err))
            skipped.append(int(meta["iteration"]))
