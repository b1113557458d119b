"""Writing a checkpoint: every rank its shard into ``iter_XXXXXXX.tmp/`` in parallel, then rank 0
checks the files and publishes them."""
from __future__ import annotations

import os
import shutil
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.comm import agree, on_rank0
from megazero.checkpoint.errors import CheckpointError, CheckpointSaveError
from megazero.checkpoint.format import (CONFIG, FORMAT, METADATA, TRACKER, arch_of, checkpoint_path,
                                        layout_of, named_params, rng_file, rng_trackers, saved_settings,
                                        scheduler_of)
from megazero.checkpoint.integrity import describe_file, fsync_dir, seal, write_bytes_durably, write_json
from megazero.checkpoint.lock import SaveLock
from megazero.checkpoint.shards import write_rank_shard, write_weights_shard

PROBE = ".megazero_write_probe"  # written and removed by check_save_dir


def _write(obj, path: str) -> None:
    """``torch.save`` to ``path``, on disk before returning (tests replace it to inject a crash)."""
    write_bytes_durably(path, lambda fh: torch.save(obj, fh))


def _probe(directory: str) -> None:
    """Create ``directory`` and write and remove a probe file (removed even when the write fails)."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"--save {directory}: exists and is not a directory; "
                              "give a directory (it is created if missing)")
    path = os.path.join(directory, f"{PROBE}.{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        write_bytes_durably(path, lambda fh: fh.write(b"megazero"))
    except OSError as err:
        raise CheckpointError(f"--save {directory}: cannot write checkpoints there "
                              f"({type(err).__name__}: {err})") from err
    finally:
        if os.path.lexists(path):
            os.remove(path)


def check_save_dir(directory: str, mesh) -> SaveLock:
    """Fail now, not at the first save (by default the end of training), when ``--save directory``
    is unusable, and make this run its only writer: global rank 0 creates the directory, writes and
    deletes a probe file and takes the directory's lock (:class:`SaveLock`, refused while another
    run holds it).  Collective; raises :class:`CheckpointError` naming ``--save`` on every rank.
    Returns the lock (held by rank 0; call ``release()`` when done saving)."""
    held = []

    def probe_and_lock() -> str:
        _probe(directory)
        held.append(SaveLock.acquire(directory))
        return held[0].run_id
    run_id = on_rank0(probe_and_lock, mesh)
    return held[0] if held else SaveLock(directory, run_id)


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


def _seal(tmp: str, meta: dict, lock: SaveLock) -> None:
    """Rank 0: check that ``tmp`` holds exactly the files the ranks reported, then write the metadata
    (the last file: a directory without it is incomplete) and make the directory durable."""
    expected = set(meta["files"]) | {METADATA}
    present = set(os.listdir(tmp)) | {METADATA}
    if present != expected:
        extra, missing = sorted(present - expected), sorted(expected - present)
        raise CheckpointError(f"{tmp}: unexpected files {extra} / missing files {missing}: another process "
                              "is writing this checkpoint; the save is not published")
    lock.check_owner()
    write_json(os.path.join(tmp, METADATA), seal(meta))
    fsync_dir(tmp)  # every rank's files are in the directory before it is renamed


def _commit(directory: str, tmp: str, final: str, iteration: int) -> None:
    """Rank 0: the rename that makes the sealed ``tmp`` the checkpoint, then the tracker.

    Saving an iteration that exists already swaps it in two renames (``iter_X`` -> ``iter_X.old``,
    ``iter_X.tmp`` -> ``iter_X``); between them the reader takes ``iter_X.old``, so the tracker
    always names a complete checkpoint, and the next save cleans up (:func:`_recover`)."""
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


def _publish(directory: str, tmp: str, final: str, iteration: int, meta: dict, lock: SaveLock) -> None:
    """Rank 0: :func:`_seal` then :func:`_commit`."""
    _seal(tmp, meta, lock)
    _commit(directory, tmp, final, iteration)


def publish(directory: str, iteration: int, mesh) -> None:
    """Make a checkpoint saved with ``publish=False`` (sealed in ``iter_X.tmp``) the latest: rename it
    and point the tracker at it (collective; the file work is global rank 0's)."""
    final = checkpoint_path(directory, iteration)
    error = None
    if mesh.rank == 0:
        try:
            _commit(directory, final + ".tmp", final, iteration)
        except OSError as err:
            error = err
    agree(error, mesh, f"publishing checkpoint {final}", CheckpointSaveError)


def discard(directory: str, iteration: int, mesh) -> Optional[str]:
    """Global rank 0 (no collective): a sealed but unpublished save of ``iteration`` is set aside as
    ``iter_X.diverged`` (never loaded; kept for inspection).  Returns its new path, or None."""
    tmp = checkpoint_path(directory, iteration) + ".tmp"
    if mesh.rank != 0 or not os.path.isdir(tmp):
        return None
    target = checkpoint_path(directory, iteration) + ".diverged"
    shutil.rmtree(target, ignore_errors=True)
    os.rename(tmp, target)
    return target


def checkpoint_meta(cfg, mesh, iteration: int, extra, run_id: str, files: dict, params: dict, optimizer: dict,
                    scheduler: dict, layout: Optional[dict] = None) -> dict:
    """A checkpoint's ``metadata.json``: ``optimizer`` (its name, state names, step, skipped steps and
    loss scaler), ``scheduler``'s settings, the ``layout`` (default: this run's), the architecture of
    ``cfg`` and every file and parameter."""
    return {"format": FORMAT, "iteration": int(iteration), "extra": dict(extra or {}), "run_id": run_id,
            "optimizer": optimizer, "scheduler": scheduler, "layout": layout or layout_of(cfg, mesh),
            "model": arch_of(cfg), "padded_vocab_size": cfg.model.padded_vocab_size, "params": params,
            "files": files, "torch_version": torch.__version__}


def _metadata(iteration: int, optimizer, mesh, cfg, extra, run_id: str, files: dict, params: dict) -> dict:
    state_names = sorted(optimizer.update.state_names()) if optimizer.buckets else []
    return checkpoint_meta(cfg, mesh, iteration, extra, run_id, files, params,
                           {"name": cfg.optimizer.optimizer, "state_names": state_names,
                            "step": int(optimizer.step_count), "skipped_steps": int(optimizer.skipped_steps),
                            "scaler": optimizer.scaler.state_dict()}, scheduler_of(cfg))


def _gather_to_rank0(obj, mesh) -> list:
    """``obj`` of every rank, in rank order, on global rank 0 (``[]`` elsewhere; collective)."""
    if not mesh.is_distributed:
        return [obj]
    out = [None] * mesh.world_size if mesh.rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=mesh.world_group)
    return out or []


def _prepare(directory: str, tmp: str, mesh) -> None:
    """Rank 0: an empty ``tmp`` (leftovers of a crashed save removed); collective."""
    error = None
    if mesh.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            _recover(directory)  # an earlier re-save that crashed mid-swap
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crashed save
            os.makedirs(tmp)
        except OSError as err:
            error = err
    agree(error, mesh, f"cannot create the checkpoint directory {tmp}", CheckpointSaveError)


def _write_rank(tmp: str, chunks, optimizer, mesh, run_id: str):
    """This rank's shard and RNG state; returns ``(files, params)``."""
    files, params = write_rank_shard(tmp, optimizer, named_params(chunks), mesh, run_id)
    rng = rng_file(mesh.coord("tp"), mesh.coord("pp"), mesh.coord("dp", "cp"))
    _write(_rng_payload(chunks, mesh), os.path.join(tmp, rng))
    files[rng] = describe_file(os.path.join(tmp, rng))
    return files, params


def _save_locked(directory: str, iteration: int, chunks, optimizer, mesh, cfg, extra, lock: SaveLock,
                 publish_now: bool = True) -> None:
    final = checkpoint_path(directory, iteration)
    tmp = final + ".tmp"
    _prepare(directory, tmp, mesh)
    error, mine = None, ({}, {})
    try:
        mine = _write_rank(tmp, chunks, optimizer, mesh, lock.run_id)
    except Exception as err:  # noqa: BLE001 - every rank learns of it below
        error = err
    try:
        agree(error, mesh, f"saving iteration {iteration} to {tmp}", CheckpointSaveError)
        gathered = _gather_to_rank0(mine, mesh)
        error = None
        if mesh.rank == 0:
            try:
                files, params = {}, {}
                for f, p in gathered:
                    files.update(f)
                    params.update(p)
                write_json(os.path.join(tmp, CONFIG), saved_settings(cfg))
                files[CONFIG] = describe_file(os.path.join(tmp, CONFIG))
                meta = _metadata(iteration, optimizer, mesh, cfg, extra, lock.run_id, files, params)
                _seal(tmp, meta, lock)
                if publish_now:
                    _commit(directory, tmp, final, iteration)
            except Exception as err:  # noqa: BLE001
                error = err
        agree(error, mesh, f"publishing checkpoint {final}", CheckpointSaveError)
    except CheckpointError:
        if mesh.rank == 0:  # every rank has stopped writing: nothing partial is left behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def save(directory: str, iteration: int, chunks, optimizer, mesh, cfg, extra: Optional[dict] = None,
         lock: Optional[SaveLock] = None, publish_now: bool = True) -> float:
    """Write the checkpoint of ``iteration`` to ``directory`` (collective: every rank calls it).

    ``chunks``: this rank's model chunks; ``optimizer``: its :class:`ZeroOptimizer`; ``extra``: a
    JSON-serialisable dict stored in the metadata (the trainer's consumed samples, skipped
    iterations) and returned by :func:`load`; ``lock``: the directory's :class:`SaveLock` from
    :func:`check_save_dir` when the caller holds it for a whole run (else it is taken for this save).
    Every rank writes its own shard at the same time.  Returns the seconds it took.  Raises
    :class:`CheckpointError` on every rank if any rank failed (the partial files are removed; the
    previous checkpoint and the tracker are unchanged), or if the model holds a NaN or inf.
    ``publish_now=False``: the checkpoint is sealed in ``iter_X.tmp`` (complete, checksummed) but not
    renamed nor named by the tracker until :func:`publish` (the trainer waits for the next iteration's
    loss); :func:`discard` sets it aside instead."""
    start = time.perf_counter()
    own = lock is None
    if own:
        lock = check_save_dir(directory, mesh)
    try:
        _save_locked(directory, iteration, chunks, optimizer, mesh, cfg, extra, lock, publish_now)
    finally:
        if own:
            lock.release()
    return time.perf_counter() - start


def save_weights(directory: str, chunks, mesh, cfg, iteration: int = 0, extra: Optional[dict] = None,
                 values=None) -> str:
    """Write model weights only as the checkpoint of ``iteration`` in ``directory`` (one process, the
    whole model: e.g. a model converted from Hugging Face).  The same format as :func:`save` (a data
    shard with block checksums, sealed metadata listing every file's size and CRC-32, the
    directory's lock held while writing), so ``--load`` reads it under every layout; its optimizer
    starts fresh (``metadata.json`` says ``weights_only``).  Returns the checkpoint's path.
    ``values``: see :func:`~megazero.checkpoint.shards.write_weights_shard` (a model on the meta
    device whose weights come one at a time)."""
    if mesh.is_distributed:
        raise ValueError("save_weights writes from one process; use save() in a distributed run")

    def write(tmp: str, run_id: str):
        files, params = write_weights_shard(tmp, named_params(chunks), mesh, run_id, values)
        fresh = {"name": None, "state_names": [], "step": 0, "skipped_steps": 0, "scaler": None}
        return files, params, dict(optimizer=fresh, scheduler={}), {"weights_only": True}
    return save_whole(directory, iteration, mesh, cfg, extra, write)


def save_whole(directory: str, iteration: int, mesh, cfg, extra, write) -> str:
    """The frame of a checkpoint one process writes whole (:func:`save_weights`, a converted Megatron-LM
    optimizer state): the directory's lock, ``iter_X.tmp``; ``write(tmp, run_id)`` writes the data and
    returns ``(files, params, checkpoint_meta's optimizer/scheduler/layout, more metadata fields)``;
    then the run's settings, the sealed metadata and the rename, nothing left behind on an error.
    Returns the checkpoint's path."""
    final = checkpoint_path(directory, iteration)
    tmp = final + ".tmp"
    lock = check_save_dir(directory, mesh)
    try:
        _prepare(directory, tmp, mesh)
        try:
            files, params, state, more = write(tmp, lock.run_id)
            write_json(os.path.join(tmp, CONFIG), saved_settings(cfg))
            files[CONFIG] = describe_file(os.path.join(tmp, CONFIG))
            meta = checkpoint_meta(cfg, mesh, iteration, extra, lock.run_id, files, params, **state)
            meta.update(more)
            _publish(directory, tmp, final, iteration, meta, lock)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        lock.release()
    return final
