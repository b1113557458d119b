"""Which checkpoint ``--load`` takes: the tracker's, else the newest complete one, skipping any whose
metadata or file list does not check out (run on global rank 0; its answer is shared).

Order of candidates: the iteration in ``latest_checkpointed_iteration.txt``, then every older
complete ``iter_*`` directory, newest first.  With a garbled or missing tracker, every complete
directory, newest first (with a warning).  A candidate is usable when its ``metadata.json`` is
intact (its own checksum), of a known format, and every file it lists is there with the recorded
size (``config.json`` also by checksum); deeper checks (block checksums of the data) happen while
the ranks read, and :func:`megazero.checkpoint.load` moves on to the next candidate when they fail.

A directory in another format is named, with what to run instead (:func:`describe_foreign`): a
Hugging Face directory, one ``iter_*`` directory, a Megatron-LM checkpoint, a checkpoint of a
format this version no longer reads.  :func:`saved_config` reads the configuration of the
checkpoint :func:`resolve_here` picks, in one process.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

from megazero.checkpoint.comm import on_rank0
from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError
from megazero.checkpoint.format import CONFIG, FORMAT, METADATA, TRACKER, checkpoint_path
from megazero.checkpoint.integrity import check_file, read_json, read_sealed_json

# formats earlier versions wrote, and the last commit that reads each
RETIRED = {"megazero-checkpoint-v1": "827a2fe"}
CONVERT = "python scripts/convert_hf.py --direction to-megazero --input {src} --output CKPT_DIR"


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration in ``DIR/latest_checkpointed_iteration.txt``, or None without a tracker."""
    path = os.path.join(directory, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:  # garbled, or -1 (no iteration is negative)
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}")
    return value


def complete_iterations(directory: str) -> List[int]:
    """Iterations with a complete ``iter_*`` directory (``metadata.json`` present), newest first."""
    found = set()
    for name in os.listdir(directory):
        stem = name[:-len(".old")] if name.endswith(".old") else name
        complete = os.path.isfile(os.path.join(directory, name, METADATA))
        if stem.startswith("iter_") and stem[5:].isdigit() and complete:
            found.add(int(stem[5:]))
    return sorted(found, reverse=True)


def read_metadata(path: str) -> dict:
    """``path/metadata.json``, checked with the files it lists; raises :class:`CheckpointCorrupt`."""
    meta = read_sealed_json(os.path.join(path, METADATA))
    if meta.get("format") != FORMAT:
        raise CheckpointError(_unknown_format(path, meta.get("format")))
    for name, expected in sorted(meta.get("files", {}).items()):
        check_file(path, name, expected, read_bytes=(name == CONFIG))
    return meta


def _unknown_format(path: str, found) -> str:
    if found in RETIRED:
        return (f"{path}: checkpoint format {found!r} is not read by this version of megazero, which reads "
                f"{FORMAT!r}; megazero at commit {RETIRED[found]} (and earlier) reads it and saves "
                f"{FORMAT!r}: resume it there with --save NEW_DIR to convert it")
    return f"{path}: not a megazero checkpoint (metadata format {found!r}, expected {FORMAT!r})"


def describe_foreign(directory: str) -> Optional[str]:
    """What a directory without a megazero tracker holds, and what to run instead; None when it is
    nothing recognisable."""
    def has(*names) -> bool:
        return all(os.path.exists(os.path.join(directory, n)) for n in names)
    if not os.path.isdir(directory):
        return None
    if has(METADATA) and os.path.basename(os.path.normpath(directory)).startswith("iter_"):
        parent = os.path.dirname(os.path.normpath(directory)) or "."
        return (f"{directory} is one iteration of a megazero checkpoint; pass its parent directory: --load "
                f"{parent} (add --ckpt-step N for an iteration other than the latest)")
    if has("config.json") and (has("model.safetensors") or has("model.safetensors.index.json")
                               or has("pytorch_model.bin")):
        return (f"{directory} is a Hugging Face model directory; convert it to a checkpoint first: "
                + CONVERT.format(src=directory) + ", then train with --load CKPT_DIR --finetune "
                "--use-checkpoint-args")
    if has("model.pt", "config.json"):
        return (f"{directory} holds a single-file megazero export (model.pt), not a training checkpoint; "
                "export it to Hugging Face with scripts/convert_hf.py --direction to-hf and convert that "
                "back with --direction to-megazero")
    names = os.listdir(directory)
    if any(n.startswith("iter_") for n in names) and not any(n.startswith(TRACKER) for n in names):
        return f"{directory} has iter_* directories but no {TRACKER}; it was not written by megazero"
    return None


def _order(directory: str, iteration: Optional[int], flag: str = "--load") -> Tuple[List[int], List[str]]:
    """Candidate iterations, newest first, and notes for the user."""
    if iteration is not None:
        return [iteration], []
    complete = complete_iterations(directory)
    try:
        tracked = latest_iteration(directory)
    except CheckpointError as err:
        if not complete:
            raise
        return complete, [f"{err}; using the newest complete checkpoint instead"]
    if tracked is None:
        if not complete:
            foreign = describe_foreign(directory)
            if foreign:
                raise CheckpointError(f"{flag} {directory}: not a megazero checkpoint directory: {foreign}")
            partial = sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))
            note = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
            raise CheckpointError(f"{flag} {directory}: no checkpoint there: {TRACKER} is missing{note}")
        return complete, [f"{flag} {directory}: {TRACKER} is missing; using the newest complete checkpoint"]
    return [tracked] + [i for i in complete if i < tracked], []


def _megatron_lm(path: str) -> bool:
    """Whether ``path`` (an ``iter_*`` directory without megazero metadata) holds a Megatron-LM checkpoint."""
    names = os.listdir(path) if os.path.isdir(path) else []
    return any(n.startswith("mp_rank_") or n.endswith(".distcp") or n == "common.pt" for n in names)


def resolve_here(directory: str, iteration: Optional[int] = None, skip: Sequence[int] = (),
                 flag: str = "--load") -> Tuple[str, dict, List[str]]:
    """``(path, metadata, notes)`` of the checkpoint to load, as this process sees the file system
    (``flag``: how the user named ``directory``, for errors).  A directory in another format (Hugging
    Face, one ``iter_*`` directory, Megatron-LM) is named with what to run instead."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{flag} {directory}: exists and is not a directory")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{flag} {directory}: no such directory")
    order, notes = _order(directory, iteration, flag)
    problems, corrupt = [], True
    for it in (i for i in order if i not in skip):
        path = checkpoint_path(directory, it)
        interrupted = os.path.isfile(os.path.join(path + ".old", METADATA))
        if not os.path.isfile(os.path.join(path, METADATA)) and interrupted:
            path += ".old"  # a re-save of this iteration was interrupted mid-swap: the previous copy
        if not os.path.isfile(os.path.join(path, METADATA)):
            if _megatron_lm(path):
                raise CheckpointError(f"{flag} {directory}: {path} is a Megatron-LM checkpoint: train "
                                      "with pretrain_gpt.py --load (it converts it), or convert it with "
                                      "scripts/convert_megatron.py")
            problems.append(f"checkpoint {path} is missing or incomplete (no {METADATA})")
            corrupt = False
            continue
        try:
            return path, read_metadata(path), notes + [f"skipped {p}" for p in problems]
        except CheckpointCorrupt as err:
            problems.append(str(err))
    tried = "; ".join(problems) if problems else "every checkpoint there failed to load"
    raise (CheckpointCorrupt if problems and corrupt else CheckpointError)(
        f"{flag} {directory}: no usable checkpoint: {tried}")


def resolve(directory: str, iteration: Optional[int], mesh, skip: Sequence[int] = ()):
    """:func:`resolve_here` on global rank 0, shared with every rank (collective)."""
    return tuple(on_rank0(lambda: resolve_here(directory, iteration, skip), mesh))


def saved_config(directory: str, iteration: Optional[int] = None) -> Optional[dict]:
    """The whole configuration (``config.json``) of a checkpoint, or None when ``directory`` does not
    exist or holds no checkpoint yet.  Raises :class:`CheckpointError` for a directory in another
    format (naming what it is)."""
    if not os.path.isdir(directory):
        return None
    from megazero.checkpoint.megatron import is_megatron_dir, saved_config as megatron_config
    if is_megatron_dir(directory, iteration):
        return megatron_config(directory, iteration)
    if iteration is None and not complete_iterations(directory):
        try:
            tracked = latest_iteration(directory)
        except CheckpointError:
            tracked = -1  # a garbled tracker: resolve_here explains
        if tracked is None:
            foreign = describe_foreign(directory)
            if foreign:
                raise CheckpointError(f"--load {directory}: not a megazero checkpoint directory: {foreign}")
            return None
    path, _, _ = resolve_here(directory, iteration)
    return read_json(os.path.join(path, CONFIG))
