"""Sharded checkpoints that load under any layout (TP, PP, DP, ZeRO stage, virtual stages), written
by every rank in parallel and read back in O(shard) memory.

On disk (``--save DIR``), after iteration 10::

    DIR/.megazero.lock                       while a run may save here: its run id (one writer per directory)
    DIR/latest_checkpointed_iteration.txt    "10": the newest complete checkpoint (Megatron's tracker)
    DIR/iter_0000010/
        metadata.json                        written last: iteration, trainer state (consumed samples,
                                             skipped iterations), optimizer step, loss-scaler state, the
                                             saving layout, the architecture, every parameter's layout,
                                             every file with its size and CRC-32, the run id, and the
                                             CRC-32 of its own content
        config.json                          the whole configuration of the saving run
        shard_tp00_pp000_dp000.bin ...       one per rank: its data-parallel slice of every bucket's fp32
                                             master weights and optimizer moments, raw float32
        shard_tp00_pp000_dp000.json ...      its index: [name, key, lo, hi, offset] per piece (elements
                                             [lo, hi) of the parameter's TP-local tensor), the CRC-32 of
                                             every 4 MiB block of the .bin, the run id
        rng_tp00_pp000_dp000.pt ...          one per rank: its generator states

Saving (:mod:`megazero.checkpoint.writer`, :mod:`megazero.checkpoint.shards`): every rank writes its
own slice at the same time, straight from the optimizer's memory, so no rank ever holds more than its
own shard (plus one bucket slice when the state lives on a GPU).  Pieces are named by the
parameter's *global* name (``decoder.<layer>.…``, the same at every pipeline layout) with how TP
splits it (a mixture of experts' weights one expert at a time, ``….experts.<e>.fc1_weight``, split
over expert TP: :mod:`megazero.checkpoint.names`, so any EP size loads them); TP-replicated
parameters are written by TP rank 0 only, the last stage's tied copy of the embedding not at all.
A NaN or inf in the state refuses the save.

Loading (:mod:`megazero.checkpoint.reader`, :mod:`megazero.checkpoint.assemble`) reshards: each rank
computes the element ranges of its new slice, maps them through the saved TP split and vocabulary
padding to byte ranges of the saved shards, and reads only those (memory-mapped, each 4 MiB block
checked against its CRC-32 once).  Nothing is committed until every rank has read and verified its
part.  ``metadata.json`` names the format (``megazero-checkpoint-v2``); a checkpoint in any other,
including the ``megazero-checkpoint-v1`` of earlier versions, is refused with an error naming it.

Integrity (:mod:`megazero.checkpoint.integrity`, :mod:`megazero.checkpoint.resolve`): a file that is
missing, truncated or altered is named in the error; ``--load`` then falls back to the previous
complete checkpoint (and with a garbled or missing tracker, to the newest complete one), with a
warning.  Every rank's files carry the run id, and rank 0 publishes only a directory holding exactly
the files its ranks reported, so two runs cannot mix a checkpoint; the directory lock
(:mod:`megazero.checkpoint.lock`) refuses a second run at start-up.

Atomicity: all ranks write into ``iter_XXXXXXX.tmp/``; once every rank reports success, global
rank 0 writes ``metadata.json``, renames the directory to ``iter_XXXXXXX`` and then replaces the
tracker file (write a temporary file, ``os.replace``).  A crash at any point leaves either the
previous tracker and no ``iter_…`` directory for the new iteration, or a complete one.  A failed
save (a full disk, an I/O error, a NaN) removes its ``*.tmp`` directory; one left by a crash is never
loaded and is removed by the next save of that iteration.  Saving an iteration that already exists
moves the old copy to ``iter_XXXXXXX.old`` just before the new one is renamed in; should a crash
fall between the two renames, loading takes the ``.old`` copy and the next save restores or removes
it.  The directory entries are fsynced after the files, before each rename and before the tracker.
The directory must be on a file system every rank sees.

Resume checks: the loss-scaler state is carried over only from a dynamic (fp16) scaler into a
dynamic one; a constant ``--loss-scale``, bf16/fp32, or a fresh fp16 run after an fp32 one keep
this run's configured scale.  ``--lr``, ``--min-lr``, ``--lr-warmup-iters``, ``--lr-decay-iters``
and ``--lr-decay-style`` must equal the checkpoint's (``metadata.json`` ``scheduler``) unless
``--override-opt-param-scheduler``; ``--train-iters`` may grow.

RNG: each rank's generator states (default generator, CUDA generator, the tensor-parallel
tracker) are restored only when the saving and loading layouts are identical (world size, TP,
PP, DP, virtual stages, uneven split, rank order) and every rank has its file; a missing or damaged
RNG file is an error naming it.  Otherwise every rank is reseeded deterministically from
``(seed, iteration)`` with the start-up rules: the default generator gets ``s + 100 * pp_rank``
and the tracker ``s + 2718 + tp_rank`` where ``s = seed + 1_000_003 * iteration``.  Without
dropout the RNG does not affect training.

Start-up (collective, before the first iteration): :func:`check_save_dir` makes global rank 0
create ``--save``, write and delete a probe file and take the directory's lock, so an unusable or
busy directory fails at once rather than at the first save; :func:`resume_iteration` decides, on
rank 0 only, whether ``--load`` resumes (and from which iteration) or starts fresh.  Every
file-system decision (tracker, metadata, the directory) is taken by global rank 0 and broadcast,
and an error on any rank is raised on every rank with the first failing rank's message.

Weights only: :func:`save_weights` (one process; ``scripts/convert_hf.py --direction to-megazero``)
writes the same v2 layout (one shard per TP rank with its block checksums, sealed metadata with
every file's size and CRC-32) with master weights and no optimizer state, RNG files or trainer
state, ``"weights_only": true`` in the metadata; loading it starts a fresh optimizer.  Loading
options (the config's checkpoint section): ``--finetune`` (weights only, iteration 0, fresh
optimizer and schedule, the generators of this run's start-up), ``--no-load-optim`` (fresh
optimizer and loss scaler; iteration and data position continue; the schedule settings are not
compared), ``--no-load-rng`` (reseeded as above), ``--ckpt-step`` (an iteration other than the
latest; no fallback to an older one then).  A directory in another format is named
(:func:`~megazero.checkpoint.resolve.describe_foreign`): a Hugging Face directory, one ``iter_*``
directory, a Megatron-LM checkpoint.

API: :func:`save`, :func:`load`, :func:`check_save_dir` and :func:`resume_iteration` are
collective (every rank calls them); :func:`latest_iteration` reads the tracker; :func:`save_weights`,
:func:`read_weights` (every full fp32 weight, any layout, no model, checksums verified; :func:`open_weights`
the same one parameter at a time) and
:func:`saved_config` run in one process.  Errors are :class:`CheckpointError`
(:class:`CheckpointCorrupt` for damaged files).

Modules, each importing only those before it: :mod:`~megazero.checkpoint.errors` (the error
classes), :mod:`~megazero.checkpoint.format` (file names, what the metadata records about model,
layout and schedule), :mod:`~megazero.checkpoint.integrity` (checksums, durable writes),
:mod:`~megazero.checkpoint.comm` (the collectives that make every rank agree),
:mod:`~megazero.checkpoint.resolve` (which checkpoint to load; foreign directories named),
:mod:`~megazero.checkpoint.lock`, :mod:`~megazero.checkpoint.shards`,
:mod:`~megazero.checkpoint.assemble`, :mod:`~megazero.checkpoint.reader`,
:mod:`~megazero.checkpoint.writer`; and :mod:`~megazero.checkpoint.megatron` (Megatron-LM's torch_dist
and legacy checkpoints converted for ``--load``, and megazero's exported to torch_dist).
"""
from megazero.checkpoint.errors import CheckpointCorrupt, CheckpointError, CheckpointSaveError  # noqa: F401
from megazero.checkpoint.format import checkpoint_path  # noqa: F401
from megazero.checkpoint.lock import SaveLock  # noqa: F401
from megazero.checkpoint.reader import load, open_weights, read_weights, resume_iteration  # noqa: F401
from megazero.checkpoint.resolve import latest_iteration, saved_config  # noqa: F401
from megazero.checkpoint.writer import check_save_dir, discard, publish, save, save_weights  # noqa: F401

__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointSaveError", "SaveLock", "check_save_dir",
           "checkpoint_path", "discard", "latest_iteration", "load", "open_weights", "publish",
           "read_weights", "resume_iteration", "save", "save_weights", "saved_config"]
