"""Writing a checkpoint: every rank its share into ``iter_XXXXXXX.tmp/``, then rank 0 publishes it."""
from __future__ import annotations

import os
import shutil
import time
from typing import Dict, Optional

import torch

from megazero.checkpoint.format import (CONFIG, FORMAT, METADATA, TRACKER, CheckpointError, all_ok, arch_of,
                                        checkpoint_path, fsync_dir, layout_of, model_file, named_params,
                                        on_rank0, scheduler_of, rng_file, rng_trackers, write_bytes_durably, write_json)

PROBE = ".megazero_write_probe"  # written and removed by check_save_dir


def _write(obj, path: str) -> None:
    """``torch.save`` to ``path``, on disk before returning (tests replace it to inject a crash)."""
    write_bytes_durably(path, lambda fh: torch.save(obj, fh))


def _agree(error: Optional[BaseException], mesh, what: str) -> None:
    """Raise on every rank if any rank failed (each failed rank with its own error)."""
    ok = all_ok(error is None, mesh)
    if error is not None:
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from error
    if not ok:
        raise CheckpointError(f"{what}: failed on another rank (see its error)")


def check_save_dir(directory: str, mesh) -> None:
    """Fail now, not at the first save (by default the end of training), when ``--save directory``
    is unusable: global rank 0 creates the directory and writes and deletes a probe file; the
    outcome is shared with every rank (collective).  Raises :class:`CheckpointError` naming
    ``--save`` and the path on every rank."""
    def probe() -> None:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise CheckpointError(f"--save {directory}: exists and is not a directory; "
                                  "give a directory (it is created if missing)")
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{PROBE}.{os.getpid()}")
            write_bytes_durably(path, lambda fh: fh.write(b"megazero"))
            os.remove(path)
        except OSError as err:
            raise CheckpointError(f"--save {directory}: cannot write checkpoints there "
                                  f"({type(err).__name__}: {err})") from err
    on_rank0(probe, mesh)


def _model_payload(chunks, states, mesh, cfg) -> Dict[str, object]:
    """This (tp, pp) coordinate's parameters: TP shard of the master weight and optimizer moments."""
    params = {}
    for name, p in named_params(chunks):
        if getattr(p, "tied_copy", False):
            continue  # equals word_embeddings.weight, which the first stage writes
        split = bool(getattr(p, "tensor_model_parallel", False))
        if not split and mesh.tp_rank != 0:
            continue  # replicated over TP: TP rank 0 writes it
        if p in states:
            state = {k: v for k, v in states[p].items() if k != "step"}
        else:  # not trained (no optimizer state): the weight itself
            state = {"master": p.detach().float().cpu().clone()}
        params[name] = {"tensor_model_parallel": split,
                        "partition_dim": int(p.partition_dim) if split else -1,
                        "vocab_parallel": bool(getattr(p, "vocab_parallel", False)),
                        "state": state}
    return {"format": FORMAT, "tp_rank": mesh.tp_rank, "tp_size": mesh.tp_size, "pp_rank": mesh.pp_rank,
            "padded_vocab_size": cfg.model.padded_vocab_size, "params": params}


def _rng_payload(chunks, mesh) -> Dict[str, object]:
    out = {"cpu": torch.get_rng_state(), "trackers": [t.get_state() for t in rng_trackers(chunks)]}
    if mesh.device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(mesh.device)
    return out


def _recover(directory: str) -> None:
    """Rank 0, before a save: finish or undo a re-save that crashed mid-swap.  ``iter_X.old`` is the
    previous copy of ``iter_X`` while the new one is moved in: it is dropped once ``iter_X`` is
    complete again, or renamed back when the crash left no ``iter_X``."""
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("iter_") and name.endswith(".old")):
            continue
        old, final = os.path.join(directory, name), os.path.join(directory, name[:-len(".old")])
        if os.path.isfile(os.path.join(final, METADATA)):
            shutil.rmtree(old, ignore_errors=True)
        elif os.path.isfile(os.path.join(old, METADATA)):
            shutil.rmtree(final, ignore_errors=True)
            os.rename(old, final)
            fsync_dir(directory)


def _publish(directory: str, tmp: str, final: str, iteration: int, meta: dict, cfg) -> None:
    """Rank 0: metadata, then the rename that makes the checkpoint exist, then the tracker.

    Saving an iteration that exists already swaps it in two renames (``iter_X`` -> ``iter_X.old``,
    ``iter_X.tmp`` -> ``iter_X``); between them the reader takes ``iter_X.old``, so the tracker
    always names a complete checkpoint, and the next save cleans up (:func:`_recover`)."""
    write_json(os.path.join(tmp, CONFIG), cfg.to_dict())
    write_json(os.path.join(tmp, METADATA), meta)  # last file: a directory without it is incomplete
    fsync_dir(tmp)  # every rank's files are in the directory before it is renamed
    old = None
    if os.path.exists(final):  # saving the same iteration again
        old = final + ".old"
        os.rename(final, old)
        fsync_dir(directory)
    os.rename(tmp, final)
    fsync_dir(directory)  # the checkpoint exists on disk before the tracker names it
    tracker_tmp = os.path.join(directory, TRACKER + ".tmp")
    write_bytes_durably(tracker_tmp, lambda fh: fh.write(f"{iteration}\n".encode()))
    os.replace(tracker_tmp, os.path.join(directory, TRACKER))
    fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save(directory: str, iteration: int, chunks, optimizer, mesh, cfg, extra: Optional[dict] = None) -> float:
    """Write the checkpoint of ``iteration`` to ``directory`` (collective: every rank calls it).

    ``chunks``: this rank's model chunks; ``optimizer``: its :class:`ZeroOptimizer`; ``extra``: a
    JSON-serialisable dict stored in the metadata (the trainer's consumed samples, skipped
    iterations) and returned by :func:`load`.  Returns the seconds it took.  Raises
    :class:`CheckpointError` on every rank if any rank failed; the previous checkpoint and the
    tracker are then unchanged."""
    start = time.perf_counter()
    final = checkpoint_path(directory, iteration)
    tmp = final + ".tmp"
    error = None
    if mesh.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            _recover(directory)  # an earlier re-save that crashed mid-swap
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crashed save
            os.makedirs(tmp)
        except OSError as err:
            error = err
    _agree(error, mesh, f"cannot create the checkpoint directory {tmp}")

    states = optimizer.param_states(dst=0)  # collective over DP: gathered to the writer (DP rank 0) only
    try:
        if mesh.dp_rank == 0:
            model_path = os.path.join(tmp, model_file(mesh.tp_rank, mesh.pp_rank))
            _write(_model_payload(chunks, states, mesh, cfg), model_path)
        rng_path = os.path.join(tmp, rng_file(mesh.tp_rank, mesh.pp_rank, mesh.dp_rank))
        _write(_rng_payload(chunks, mesh), rng_path)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = err
    del states
    _agree(error, mesh, f"saving iteration {iteration} to {tmp}")

    if mesh.rank == 0:
        state_names = sorted(k for st in optimizer.state.values() for k in st) if optimizer.state else []
        meta = {"format": FORMAT, "iteration": int(iteration), "extra": dict(extra or {}),
                "optimizer": {"name": cfg.optimizer.optimizer, "state_names": sorted(set(state_names)),
                              "step": int(optimizer.step_count),
                              "skipped_steps": int(optimizer.skipped_steps),
                              "scaler": optimizer.scaler.state_dict()},
                "scheduler": scheduler_of(cfg), "layout": layout_of(cfg, mesh), "model": arch_of(cfg),
                "padded_vocab_size": cfg.model.padded_vocab_size,
                "model_files": [model_file(t, p) for p in range(mesh.pp_size) for t in range(mesh.tp_size)],
                "torch_version": torch.__version__}
        try:
            _publish(directory, tmp, final, iteration, meta, cfg)
        except Exception as err:  # noqa: BLE001
            error = err
    _agree(error, mesh, f"publishing checkpoint {final}")
    return time.perf_counter() - start


def save_weights(directory: str, chunks, mesh, cfg, iteration: int = 0, extra: Optional[dict] = None) -> str:
    """Write model weights only as the checkpoint of ``iteration`` in ``directory`` (one process, the
    whole model: e.g. a model converted from Hugging Face).  It has the layout of any checkpoint, so
    ``--load`` reads it under every layout; its optimizer starts fresh (``metadata.json`` says
    ``weights_only``).  Returns the checkpoint's path."""
    if mesh.is_distributed:
        raise ValueError("save_weights writes from one process; use save() in a distributed run")
    final = checkpoint_path(directory, iteration)
    tmp = final + ".tmp"
    os.makedirs(directory, exist_ok=True)
    _recover(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _write(_model_payload(chunks, {}, mesh, cfg), os.path.join(tmp, model_file(0, 0)))
    meta = {"format": FORMAT, "iteration": int(iteration), "weights_only": True, "extra": dict(extra or {}),
            "optimizer": {"name": None, "state_names": [], "step": 0, "skipped_steps": 0, "scaler": None},
            "scheduler": {}, "layout": layout_of(cfg, mesh), "model": arch_of(cfg),
            "padded_vocab_size": cfg.model.padded_vocab_size, "model_files": [model_file(0, 0)],
            "torch_version": torch.__version__}
    _publish(directory, tmp, final, iteration, meta, cfg)
    return final
