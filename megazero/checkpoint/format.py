"""File names, metadata and the small helpers :mod:`writer` and :mod:`reader` share."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

FORMAT = "megazero-checkpoint-v2"  # per-rank data shards (megazero.checkpoint.shards)
FORMAT_V1 = "megazero-checkpoint-v1"  # one torch file per (tp, pp) shard: still loaded
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
CONFIG = "config.json"
EMBEDDING = "word_embeddings.weight"  # where a tied output head's weight is stored

# ModelConfig fields that fix the parameter set and shapes (compared on load)
ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "vocab_size", "max_position_embeddings", "position_embedding_type",
               "normalization", "activation", "add_bias_linear", "untie_embeddings_and_output_weights")

# OptimizerConfig fields of the learning-rate schedule (compared on load unless
# --override-opt-param-scheduler, as Megatron-LM does)
SCHEDULER_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_warmup_init",
                    "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_style",
                    "lr_wsd_decay_iters", "lr_wsd_decay_samples", "decoupled_lr", "decoupled_min_lr")

# ModelConfig fields --use-checkpoint-args takes from a checkpoint (Megatron-LM's list, in megazero's terms)
CHECKPOINT_ARGS = ARCH_FIELDS + ("seq_length", "norm_epsilon", "rotary_base", "add_qkv_bias",
                                 "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                                 "rope_scaling_high_freq_factor",
                                 "rope_scaling_original_max_position_embeddings",
                                 "rotary_seq_len_interpolation_factor")

CONVERT = "python scripts/convert_hf.py --direction to-megazero --input {src} --output CKPT_DIR"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the path or parameter."""


def checkpoint_path(directory: str, iteration: int) -> str:
    """``DIR/iter_0000010``: the directory of one iteration's checkpoint."""
    return os.path.join(directory, f"iter_{iteration:07d}")


def model_file(tp_rank: int, pp_rank: int) -> str:
    return f"model_tp{tp_rank:02d}_pp{pp_rank:03d}.pt"


def rng_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"rng_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:03d}.pt"


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration in ``DIR/latest_checkpointed_iteration.txt``, or None without a tracker."""
    path = os.path.join(directory, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None


def layout_of(cfg, mesh) -> Dict[str, object]:
    """Everything that decides which rank holds what (RNG states are kept only when it matches)."""
    par = cfg.parallel
    return {"world_size": mesh.world_size, "tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size,
            "zero_stage": par.zero_stage, "rank_order": mesh.order,
            "virtual_stage_layers": par.num_layers_per_virtual_pipeline_stage,
            "first_stage_layers": par.decoder_first_pipeline_num_layers,
            "last_stage_layers": par.decoder_last_pipeline_num_layers}


def scheduler_of(cfg) -> Dict[str, object]:
    return {k: getattr(cfg.optimizer, k) for k in SCHEDULER_FIELDS}


def arch_of(cfg) -> Dict[str, object]:
    return {k: getattr(cfg.model, k) for k in ARCH_FIELDS}


def named_params(chunks) -> List[Tuple[str, torch.nn.Parameter]]:
    """This rank's parameters by global name, each once (chunks never share a name)."""
    seen, out = set(), []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def rng_trackers(chunks) -> list:
    """The distinct tensor-parallel RNG trackers the chunks use (``chunk.rng_tracker``)."""
    seen, out = set(), []
    for chunk in chunks:
        t = getattr(chunk, "rng_tracker", None)
        if t is not None and hasattr(t, "get_state") and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def all_ok(ok: bool, mesh) -> bool:
    """True on every rank when ``ok`` is true on every rank (a collective; also a barrier)."""
    if not mesh.is_distributed:
        return ok
    device = mesh.device if mesh.backend == "nccl" else torch.device("cpu")
    failed = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(failed, group=mesh.world_group)
    return int(failed.item()) == 0


def agree(error: Optional[BaseException], mesh, what: str) -> None:
    """Raise on every rank when any rank failed (collective): the same :class:`CheckpointError`
    everywhere, with the first failing rank's message (its class kept for a corrupt checkpoint), so
    rank 0 can report the real cause once."""
    ok = all_ok(error is None, mesh)
    if ok:
        return
    mine = None if error is None else (mesh.rank, _message(error), type(error).__name__)
    reports = [mine]
    if mesh.is_distributed:
        reports = [None] * mesh.world_size
        dist.all_gather_object(reports, mine, group=mesh.world_group)
    rank, message, kind = next(r for r in reports if r is not None)
    where = f"rank {rank}: " if mesh.is_distributed else ""
    text = message if message.startswith(what) or not what else f"{what}: {message}"
    raise _error_class(kind)(where + text) from error


def _message(err: BaseException) -> str:
    import errno as errno_codes
    if isinstance(err, OSError) and err.errno == errno_codes.ENOSPC:
        return (f"no space left on device ({err.filename or 'writing a checkpoint file'}); the partial "
                "checkpoint was removed and the previous one is intact: free space or choose another --save")
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def on_rank0(fn, mesh):
    """``fn()`` run by global rank 0 only, its result (or error) given to every rank by one broadcast
    over the world group (a collective): file-system decisions (tracker, metadata, a writable
    directory) cannot differ between ranks, e.g. on a shared file system that caches attributes.
    An error is raised on every rank as :class:`CheckpointError` with rank 0's message."""
    result, message, error, kind = None, None, None, None
    if mesh.rank == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, none may hang
            error, kind = err, type(err).__name__
            message = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    if mesh.is_distributed:
        box = [(result, message, kind)]
        device = mesh.device if mesh.backend == "nccl" else None
        dist.broadcast_object_list(box, src=0, group=mesh.world_group, device=device)
        result, message, kind = box[0]
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(message) from error
    if message is not None:
        raise _error_class(kind)(message)
    return result


def _error_class(kind: Optional[str]):
    """The checkpoint error class named ``kind`` (so every rank raises the same type)."""
    if kind == "CheckpointCorrupt":
        from megazero.checkpoint.integrity import CheckpointCorrupt
        return CheckpointCorrupt
    return CheckpointError


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created, renames) durable, where supported."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: str, write) -> None:
    """``write(fh)`` into ``path``, flushed to disk before returning."""
    with open(path, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_json(path: str, obj) -> None:
    write_bytes_durably(path, lambda fh: fh.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


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
                "export it to Hugging Face with scripts/convert_hf.py --direction to-hf and convert that back "
                "with --direction to-megazero")
    names = os.listdir(directory)
    if any(n.startswith("iter_") for n in names) and not any(n.startswith(TRACKER) for n in names):
        return f"{directory} has iter_* directories but no {TRACKER}; it was not written by megazero"
    return None


def resolve_checkpoint(directory: str, iteration: Optional[int] = None, flag: str = "--load") -> Tuple[str, dict]:
    """``(path, metadata)`` of the latest usable checkpoint in ``directory`` (or of ``iteration``), as
    this process sees the file system, its metadata and file sizes checked
    (:func:`megazero.checkpoint.resolve.resolve_here`).  Raises :class:`CheckpointError` saying what
    the directory is (``flag``: how the user named it)."""
    from megazero.checkpoint.resolve import resolve_here
    path, meta, _ = resolve_here(directory, iteration, flag=flag)
    return path, meta


def saved_config(directory: str, iteration: Optional[int] = None) -> Optional[dict]:
    """The whole configuration (``config.json``) of a checkpoint, or None when ``directory`` does not
    exist or holds no checkpoint yet.  Raises :class:`CheckpointError` for a directory in another
    format (naming what it is)."""
    from megazero.checkpoint.resolve import complete_iterations
    if not os.path.isdir(directory):
        return None
    if iteration is None and not complete_iterations(directory):
        try:
            tracked = latest_iteration(directory)
        except CheckpointError:
            tracked = -1  # a garbled tracker: resolve_checkpoint explains
        if tracked is None:
            foreign = describe_foreign(directory)
            if foreign:
                raise CheckpointError(f"--load {directory}: not a megazero checkpoint directory: {foreign}")
            return None
    path, _ = resolve_checkpoint(directory, iteration)
    return read_json(os.path.join(path, CONFIG))
