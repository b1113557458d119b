"""Sharded checkpoints that load under any layout (TP, PP, DP, ZeRO stage, virtual stages).

On disk (``--save DIR``), after iteration 10::

    DIR/latest_checkpointed_iteration.txt    "10": the newest complete checkpoint (Megatron's tracker)
    DIR/iter_0000010/
        metadata.json                        written last: iteration, trainer state (consumed samples,
                                             skipped iterations), optimizer step, loss-scaler state,
                                             the saving layout, the model architecture, the file list
        config.json                          the whole configuration of the saving run
        model_tp00_pp000.pt ...              one file per (tensor-parallel rank, pipeline stage)
        rng_tp00_pp000_dp000.pt ...          one file per rank: its generator states

A model file is written by the data-parallel rank 0 of its (tp, pp) coordinate and maps every
parameter of that stage, by its *global* name (``decoder.<layer>.…``; the same at every pipeline
layout), to this TP rank's shard of the fp32 master weight and the optimizer moments
(``exp_avg``/``exp_avg_sq`` or ``momentum_buffer``), with how it is sharded
(``tensor_model_parallel``, ``partition_dim``, ``vocab_parallel``).  The DP/ZeRO axis is removed
before writing: :meth:`ZeroOptimizer.param_states` gathers each parameter's state over DP to DP
rank 0 only, bucket by bucket (collective; the other DP ranks hold no full copy), so a file never
depends on the ZeRO stage or DP size.  Parameters replicated over
TP are written by TP rank 0 only; the last stage's copy of a tied embedding
(``output_layer.weight`` with ``tied_copy``) is not written (it equals ``word_embeddings.weight``).
The compute-dtype weights are not stored separately: they are the master weights cast down.

Loading reshards: every rank opens the model files (memory-mapped, so it reads only what it
needs), and for each of its parameters concatenates the saved TP pieces along
``partition_dim``, strips the saved vocabulary padding, pads to this run's padded vocabulary and
keeps this TP rank's slice; the stage picks its names, whatever the saving PP layout was; the
optimizer keeps its own DP/ZeRO slice (:meth:`ZeroOptimizer.load_param_states`).  A tied copy
loads from ``word_embeddings.weight``.

Atomicity: all ranks write into ``iter_XXXXXXX.tmp/``; once every rank reports success, global
rank 0 writes ``metadata.json``, renames the directory to ``iter_XXXXXXX`` and then replaces the
tracker file (write a temporary file, ``os.replace``).  A crash at any point leaves either the
previous tracker and no ``iter_…`` directory for the new iteration, or a complete one.  A
``*.tmp`` directory is never loaded and is removed by the next save of that iteration.  Saving
an iteration that already exists moves the old copy to ``iter_XXXXXXX.old`` just before the new
one is renamed in; should a crash fall between the two renames, loading takes the ``.old`` copy
(the tracker still names a complete checkpoint) and the next save restores or removes it.  The
directory entries are fsynced after the files, before each rename and before the tracker.  The
directory must be on a file system every rank sees.

Resume checks: the loss-scaler state is carried over only from a dynamic (fp16) scaler into a
dynamic one; a constant ``--loss-scale``, bf16/fp32, or a fresh fp16 run after an fp32 one keep
this run's configured scale.  ``--lr``, ``--min-lr``, ``--lr-warmup-iters``, ``--lr-decay-iters``
and ``--lr-decay-style`` must equal the checkpoint's (``metadata.json`` ``scheduler``) unless
``--override-opt-param-scheduler``; ``--train-iters`` may grow.

RNG: each rank's generator states (default generator, CUDA generator, the tensor-parallel
tracker) are restored only when the saving and loading layouts are identical (world size, TP,
PP, DP, virtual stages, uneven split, rank order).  Otherwise every rank is reseeded
deterministically from ``(seed, iteration)`` with the start-up rules: the default generator gets
``s + 100 * pp_rank`` and the tracker ``s + 2718 + tp_rank`` where
``s = seed + 1_000_003 * iteration``.  Without dropout the RNG does not affect training.

Start-up (collective, before the first iteration): :func:`check_save_dir` makes global rank 0
create ``--save`` and write and delete a probe file, so an unusable directory fails at once
rather than at the first save; :func:`resume_iteration` decides, on rank 0 only, whether
``--load`` resumes (and from which iteration) or starts fresh.  Every file-system decision
(tracker, metadata, the directory) is taken by global rank 0 and broadcast, so ranks never
disagree on a shared file system that caches attributes; an error is raised on every rank.

Weights only: :func:`save_weights` (one process; ``scripts/convert_hf.py --direction to-megazero``)
writes the same layout with master weights and no optimizer state, RNG files or trainer state,
``"weights_only": true`` in the metadata; loading it starts a fresh optimizer.  Loading options
(the config's checkpoint section): ``--finetune`` (weights only, iteration 0, fresh optimizer and
schedule, the generators of this run's start-up), ``--no-load-optim`` (fresh optimizer and loss
scaler; iteration and data position continue; the schedule settings are not compared),
``--no-load-rng`` (reseeded as above), ``--ckpt-step`` (an iteration other than the latest).  A
directory in another format is named (:func:`~megazero.checkpoint.format.describe_foreign` and
:func:`~megazero.checkpoint.format.resolve_checkpoint`): a Hugging Face directory, one ``iter_*``
directory, a Megatron-LM checkpoint.

API: :func:`save`, :func:`load`, :func:`check_save_dir` and :func:`resume_iteration` are
collective (every rank calls them); :func:`latest_iteration` reads the tracker; :func:`save_weights`,
:func:`read_weights` (every full fp32 weight, any layout, no model) and :func:`saved_config` run in
one process.  Errors are :class:`CheckpointError`.
"""
from megazero.checkpoint.format import (CheckpointError, checkpoint_path, latest_iteration,  # noqa: F401
                                        saved_config)
from megazero.checkpoint.reader import load, read_weights, resume_iteration  # noqa: F401
from megazero.checkpoint.writer import check_save_dir, save, save_weights  # noqa: F401

__all__ = ["CheckpointError", "check_save_dir", "checkpoint_path", "latest_iteration", "load", "read_weights",
           "resume_iteration", "save", "save_weights", "saved_config"]
