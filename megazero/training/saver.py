"""When a checkpoint the trainer saved becomes the one to resume from, and which old ones go.

A save during training is *sealed* (complete and checksummed, in ``iter_X.tmp``) but published (renamed
to ``iter_X`` and named by the tracker) only once the next iteration's forward loss, computed from
exactly the saved weights, is finite and within ``--loss-spike-factor``: a diverged state never
becomes the latest, and the error after a divergence names the last good checkpoint.  A divergence
sets the sealed save aside as ``iter_X.diverged``.  The save at the end of a run (the last iteration,
a signal, a time or iteration limit) is published at once: its own loss was checked.

``--async-save``: each rank snapshots its state to memory and a background thread writes it while
training goes on (:mod:`megazero.checkpoint.background`); the checkpoint is sealed and published as
above once the write is done, and the next save (or the end of the run) waits for the previous one.

``--ckpt-format torch_dist``: the checkpoints go to ``--save``'s ``megazero_state/`` and each published
one is also written in Megatron-LM's layout under ``--save`` (:mod:`megazero.checkpoint.megatron.save`).

``--ckpt-keep N``: after each publication global rank 0 removes all but the newest ``N`` published
checkpoints (never the one the tracker names).
"""
from __future__ import annotations

import os
import shutil
from typing import List, Optional

from megazero.checkpoint.format import checkpoint_path
from megazero.checkpoint.resolve import complete_iterations, latest_iteration


class Saver:
    """The trainer's checkpoint saves for one run (``guard``: the :class:`RunGuard`, whose ``good``
    it keeps up to date and whose ``save_lock`` it writes under)."""

    def __init__(self, cfg, chunks, optimizer, mesh, logger, guard):
        self.cfg, self.chunks, self.optimizer, self.mesh = cfg, chunks, optimizer, mesh
        self.logger, self.guard = logger, guard
        self.directory = cfg.checkpoint.save
        self.megatron = _megatron_layout(cfg, logger)  # --ckpt-format torch_dist: also Megatron-LM's files
        if self.megatron:
            from megazero.checkpoint.megatron.save import state_dir
            self.directory = state_dir(cfg.checkpoint.save)
        self.pending: Optional[int] = None  # sealed, waiting for the next iteration's loss
        self.checked = False  # that loss checked out (an --async-save still being written stays pending)
        self.background = None  # an --async-save in flight (megazero.checkpoint.background.AsyncSave)
        self.host = None  # its host buffers, reused by the next one

    # ---- saving ----------------------------------------------------------------------------------
    def save(self, iteration: int, position, final: bool = False) -> None:
        """Save ``iteration`` (``position``: consumed samples, skipped iterations, learning-rate
        samples); published at once when ``final``, else once :meth:`confirm` is called."""
        from megazero.checkpoint import save
        if self.pending is not None:  # a second save waits for the first (checked by this iteration's loss)
            self.confirm(final=True)
        self.guard.phase("checkpoint save")
        self.optimizer.finish_param_sync()  # parameters complete before anything reads them
        consumed, skipped_total, lr_samples = position
        extra = {"consumed_samples": consumed, "skipped_iterations": skipped_total, "lr_samples": lr_samples}
        if self.logger.wandb_id:  # rank 0's metadata: a resumed run continues this wandb run
            extra["wandb_run_id"] = self.logger.wandb_id
        missed = [row for row in self.logger.unwritten if row["iteration"] <= iteration]
        if missed:  # rows a full disk kept out of --metrics-file: a resumed run writes them
            extra["metrics_rows"] = missed
        if self.cfg.checkpoint.async_save and not final:
            from megazero.checkpoint.background import AsyncSave
            self.background = AsyncSave(self.directory, iteration, self.chunks, self.optimizer, self.mesh,
                                        self.cfg, extra, self.guard.save_lock, self.host)
            self.logger.print(f"saving checkpoint at iteration {iteration} to {self.directory} in the "
                              f"background (snapshot in {self.background.snapshot_seconds:.2f} s)")
            self.pending, self.checked = iteration, False
            return
        seconds = save(self.directory, iteration, self.chunks, self.optimizer, self.mesh, self.cfg,
                       extra=extra, lock=self.guard.save_lock, publish_now=final)
        self.logger.print(f"saved checkpoint at iteration {iteration} to {self.directory} in {seconds:.2f} s")
        if final:
            self._published(iteration)
        else:
            self.pending, self.checked = iteration, False

    def wait(self) -> None:
        """Wait for an ``--async-save`` in flight to be written and sealed (collective)."""
        if self.background is not None:
            job, self.background = self.background, None
            seconds = job.finish()
            self.host = job.host
            self.logger.print(f"saved checkpoint at iteration {job.iteration} to {self.directory} "
                              f"(written in the background in {seconds:.2f} s)")

    # ---- publishing ------------------------------------------------------------------------------
    def confirm(self, final: bool = False) -> None:
        """The loss after the pending save checked out (or the run ends, ``final``): publish it.  An
        ``--async-save`` still being written stays pending, unless ``final`` (then it is waited for)."""
        from megazero.checkpoint import publish
        if self.pending is None:
            return
        self.checked = True
        if self.background is not None:
            if not (final or self.background.done()):
                return
            self.wait()
        publish(self.directory, self.pending, self.mesh)
        self._published(self.pending)
        self.pending = None

    def reject(self) -> Optional[str]:
        """A divergence: the pending save is set aside (global rank 0 renames it ``iter_X.diverged``);
        returns a sentence saying so, on rank 0."""
        from megazero.checkpoint import discard
        if self.pending is None:
            return None
        if self.checked:  # the loss after it checked out earlier: it is good, only still being written
            self.confirm(final=True)
            return None
        if self.background is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - the run is failing already; its error is the one to report
                self.background = None
        it, self.pending = self.pending, None
        path = discard(self.directory, it, self.mesh)
        return None if path is None else (f"The save of iteration {it} (whose weights gave this loss) was "
                                          f"not published; it is kept aside as {path}.")

    def close(self) -> None:
        """End of the run: finish an --async-save in flight and publish what is pending (collective)."""
        self.confirm(final=True)

    def abandon(self) -> None:
        """A failure: let an --async-save in flight finish its files without publishing them."""
        if self.background is not None:
            self.background.abandon()
            self.background = None

    def _published(self, iteration: int) -> None:
        self.guard.good = f"iteration {iteration} in {self.directory}"
        if self.megatron:  # collective: every rank writes its share of Megatron-LM's files of the save
            from megazero.checkpoint.megatron.save import write_megatron
            path = write_megatron(self.cfg, iteration, self.mesh)
            self.logger.print(f"wrote Megatron-LM's torch_dist checkpoint {path}")
        keep = self.cfg.checkpoint.ckpt_keep
        if keep and self.mesh.rank == 0:
            removed = prune(self.directory, keep)
            for path in removed:
                self.logger.print(f"--ckpt-keep {keep}: removed {path}")
            if self.megatron:
                from megazero.checkpoint.megatron.save import prune_megatron
                prune_megatron(self.cfg.checkpoint.save, removed)


def _megatron_layout(cfg, logger) -> bool:
    """``--ckpt-format torch_dist`` with a model Megatron-LM's GPTModel holds (else a note: megazero's
    own format only, as before, so that Megatron-LM's scripts of other models keep running)."""
    from dataclasses import asdict
    if getattr(cfg.checkpoint, "ckpt_format", None) != "torch_dist":
        return False
    from megazero.checkpoint.megatron.save import not_written
    why = not_written(asdict(cfg.model), asdict(cfg.moe))
    if why:
        logger.print(f"megazero: note: {why}; --save {cfg.checkpoint.save} holds megazero's format only")
    return why is None


def prune(directory: str, keep: int) -> List[str]:
    """Remove all but the newest ``keep`` complete checkpoints in ``directory`` (never the one the tracker
    names, nor anything newer than it); returns the removed paths (one process)."""
    try:
        tracked = latest_iteration(directory)
    except Exception:  # noqa: BLE001 - a garbled tracker: prune nothing
        return []
    if tracked is None:
        return []
    published = [i for i in complete_iterations(directory) if i <= tracked]
    removed = []
    for it in published[keep:]:
        if it == tracked:
            continue
        path = checkpoint_path(directory, it)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
