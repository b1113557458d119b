"""What a training run reports: a console line, a progress bar, a metrics JSONL file, TensorBoard
and wandb.

Only global rank 0 writes.  :class:`TrainingLogger.log` takes one dict per iteration (the
trainer's metrics) and sends the same values everywhere:

* ``--metrics-file``: one JSON object per iteration, every value as given, appended; a run that
  starts after iteration K (a resumed checkpoint's) first repairs the file: it drops the rows after
  K and any row cut short (a full disk, a crash), and adds the rows the checkpoint holds because a
  full disk kept them out, so each iteration appears once and no row is appended onto a partial one;
* ``--tensorboard-dir``: every numeric value as a scalar of the same name (torch's SummaryWriter);
* wandb (``--wandb-project``, ``--wandb-entity``): ``wandb.log(values, step=iteration)``, the full
  config as the run config; a resumed run continues the wandb run whose id its checkpoint holds;
  mode from ``--wandb-mode``, else ``WANDB_MODE``, else ``online`` with ``WANDB_API_KEY`` in the
  environment and ``offline`` without;
* the console: a line for the first iteration, every ``--log-interval`` iterations, the last
  one and evaluations; on a terminal, a progress bar redrawn every iteration.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from megazero.errors import LOCAL, MegazeroError


def wandb_mode(requested: Optional[str]) -> str:
    """The wandb mode: ``--wandb-mode``, else ``WANDB_MODE``, else online with an API key, else offline."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE") in ("online", "offline", "disabled"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024.0
    return f"{n:.1f} GiB"


def format_line(m: Dict[str, Any], train_iters: int) -> str:
    """The console line of one iteration's metrics (fields that are absent are left out)."""
    width = len(str(train_iters))
    parts = [f"iteration {m['iteration']:>{width}}/{train_iters}"]
    if m.get("loss") is not None:
        parts.append(f"loss {m['loss']:.4f}")
    if m.get("mtp_loss") is not None:  # multi-token prediction: its depths' mean loss, apart
        parts.append(f"mtp loss {m['mtp_loss']:.4f}")
    if "eval_loss" in m:
        parts.append(f"eval loss {m['eval_loss']:.4f} (ppl {m['eval_ppl']:.2f})")
    for key in [k for k in m if k.startswith("eval_loss-")]:  # --multiple-validation-sets, by name
        name = key[len("eval_loss-"):]
        parts.append(f"eval loss {name} {m[key]:.4f} (ppl {m['eval_ppl-' + name]:.2f})")
    if "test_loss" in m:  # --test-data-path, after the last iteration
        parts.append(f"test loss {m['test_loss']:.4f} (ppl {m['test_ppl']:.2f})")
    parts.append(f"lr {m['lr']:.3e}")
    if m.get("grad_norm") is not None:
        parts.append(f"grad norm {m['grad_norm']:.3f}")
    parts.append(f"loss scale {m['loss_scale']:g}")
    if m.get("moe_imbalance") is not None:  # a mixture of experts: the routers' step
        named = (("moe_aux_loss", "aux loss"), ("moe_z_loss", "z loss"))
        losses = "".join(f"{label} {m[key]:.4f} " for key, label in named if key in m)
        parts.append(f"moe {losses}tokens/expert {m['moe_tokens_per_expert_min']:.0f}-"
                     f"{m['moe_tokens_per_expert_max']:.0f} (imbalance {m['moe_imbalance']:.2f}) dropped "
                     f"{m['moe_dropped_tokens']:.0f}")
    parts.append(f"skipped {m.get('skipped_total', int(m.get('skipped', 0)))}")
    parts.append(f"{m['iteration_time'] * 1000:.0f} ms/it")
    parts.append(f"{m['tokens_per_sec']:.0f} tok/s")
    if m.get("tflops") is not None:
        hw = m.get("hw_tflops")
        extra = f" (hw {hw:.3g} with recompute)" if hw is not None and hw > m["tflops"] * (1 + 1e-9) else ""
        parts.append(f"{m['tflops']:.3g} TFLOP/s/dev{extra}")
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    state = sum(m.get(k, 0) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes"))
    if state:
        parts.append(f"model state {_bytes(state)}/rank")
    if m.get("max_memory_allocated"):
        parts.append(f"peak mem {_bytes(m['max_memory_allocated'])}")
    return " | ".join(parts)


def progress_bar(iteration: int, total: int, started: float, loss: Optional[float], width: int = 30) -> str:
    """``[#####.....]  12/100  loss 4.1234  eta 1m05s``"""
    frac = iteration / total if total else 1.0
    filled = int(round(frac * width))
    elapsed = time.monotonic() - started
    eta = elapsed / iteration * (total - iteration) if iteration else 0.0
    loss_text = f"  loss {loss:.4f}" if loss is not None and math.isfinite(loss) else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {iteration}/{total}{loss_text}  "
            f"eta {int(eta // 60)}m{int(eta % 60):02d}s")


def tensorboard_writer_class():
    """torch's ``SummaryWriter``; ImportError naming the flag and the fix without tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError("--tensorboard-dir needs the tensorboard package, which is not installed: "
                          "pip install tensorboard (or drop --tensorboard-dir)") from None
    return SummaryWriter


class MetricsFileError(MegazeroError, OSError):
    """``--metrics-file`` cannot be prepared at start-up (repaired, trimmed, opened): rank 0, the only
    writer, reports it in one line."""

    kind = LOCAL


def _parse_row(line: str) -> Optional[Tuple[str, dict]]:
    """``(text, row)`` of one line of a metrics file, or None for a row cut short.  A line that a
    cut-short row and the next row share (``{"iteration": 27, "los{"iteration": 28, ...}``, written
    before rows stopped being appended onto a partial one) gives its last row."""
    last = line.rfind('{"iteration"')
    for start in [0] + ([last] if last > 0 else []):
        try:
            row = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(row, dict):
            return line[start:], row
    return None


def repair_metrics_rows(text: str, last_iteration: int) -> Tuple[List[str], int]:
    """The rows of a metrics file's ``text`` that are whole JSON objects with an ``iteration`` of at
    most ``last_iteration`` (objects without one are kept), one per line; also how many were dropped
    (rows after ``last_iteration``, rows cut short).  NUL bytes (what some file systems leave after
    a crash mid-write) and blank lines go."""
    kept, dropped = [], 0
    for line in text.replace("\x00", "").splitlines():
        if not line.strip():
            continue
        parsed = _parse_row(line.strip())
        if parsed is None or (isinstance(parsed[1].get("iteration"), int)
                              and parsed[1]["iteration"] > last_iteration):
            dropped += 1
            continue
        kept.append(parsed[0] + "\n")
    return kept, dropped


def trim_metrics_file(path: str, last_iteration: int, missed: Sequence[dict] = ()) -> int:
    """Repair ``path`` before a run appends to it: drop its rows after ``last_iteration`` (written by a
    run that went on past the checkpoint it is resumed from, or by an earlier run of a fresh start)
    and any row cut short (a full disk, a crash mid-write: a partial row, with or without its
    newline), so that each iteration appears once and no row is ever appended onto a partial one;
    then add the rows of ``missed`` (rows a run could not write, kept in its checkpoint) up to
    ``last_iteration`` that the file lacks.  Returns how many rows were dropped.  The file is
    replaced atomically, and only when it changes."""
    if not os.path.isfile(path):
        data = b""
    else:
        with open(path, "rb") as fh:
            data = fh.read()
    kept, dropped = repair_metrics_rows(data.decode("utf-8", errors="replace"), last_iteration)
    have = {row.get("iteration") for row in (json.loads(line) for line in kept)}
    for row in sorted((r for r in missed if r.get("iteration") not in have
                       and isinstance(r.get("iteration"), int) and r["iteration"] <= last_iteration),
                      key=lambda r: r["iteration"]):
        kept.append(json.dumps(row, allow_nan=False) + "\n")
    new = "".join(kept).encode()
    if new != data and (data or new):
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(new)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError:
            if os.path.lexists(tmp):
                os.remove(tmp)
            raise
    return dropped


def clean_row(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """One iteration's metrics as a strict-JSON row: a non-finite value (the grad norm of a skipped fp16
    step) becomes null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


class TrainingLogger:
    """Console, progress bar, metrics file, TensorBoard and wandb for one run (only rank 0 writes).

    ``start_iteration``: the iteration the run starts after (a resumed checkpoint's, else 0): the
    metrics file is repaired (:func:`trim_metrics_file`), keeps its rows up to it and this run
    appends.  ``wandb_id``: the wandb run to continue (stored in the checkpoint), when there is one.
    ``missed_rows``: rows an earlier run could not write (a full disk; stored in the checkpoint it
    saved, from :attr:`unwritten`), added to the file."""

    def __init__(self, cfg, rank: int = 0, stream: Optional[TextIO] = None, start_iteration: int = 0,
                 wandb_id: Optional[str] = None, missed_rows: Sequence[dict] = ()):
        self.cfg, self.active = cfg, rank == 0
        self.stream = stream if stream is not None else sys.stdout
        self.interval = max(1, cfg.logging.log_interval)
        self.total = cfg.training.train_iters
        self.tty = self.active and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.monotonic()
        self.metrics_fh = self.wandb_run = self.tensorboard = None
        self.dropped_rows = 0
        self.io_error: Optional[str] = None  # a metrics file or TensorBoard write failed (rank 0): why
        self.unwritten: List[dict] = []  # metrics rows a failed write kept out of the file
        if not self.active:
            return
        lc = cfg.logging
        if lc.metrics_file:
            self._open_metrics(lc.metrics_file, start_iteration, missed_rows)
        if lc.tensorboard_dir:
            self.tensorboard = tensorboard_writer_class()(log_dir=lc.tensorboard_dir)
        if lc.wandb_project and wandb_mode(lc.wandb_mode) != "disabled":
            self.wandb_run = self._start_wandb(wandb_id)

    def _open_metrics(self, path: str, start_iteration: int, missed_rows: Sequence[dict]) -> None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.dropped_rows = trim_metrics_file(path, start_iteration, missed_rows)
            self.metrics_fh = open(path, "a")
        except OSError as err:
            why = (err.strerror or str(err)).lower()
            raise MetricsFileError(f"--metrics-file {path}: {why} (errno {err.errno}) while repairing or "
                                   "opening it; free space or choose another --metrics-file") from None

    def _start_wandb(self, wandb_id: Optional[str]):
        import wandb
        lc = self.cfg.logging
        if lc.wandb_save_dir:
            os.makedirs(lc.wandb_save_dir, exist_ok=True)
        resume = {"id": wandb_id, "resume": "allow"} if wandb_id else {}
        return wandb.init(project=lc.wandb_project, entity=lc.wandb_entity, name=lc.wandb_exp_name,
                          dir=lc.wandb_save_dir, config=self.cfg.to_dict(), mode=wandb_mode(lc.wandb_mode),
                          **resume)

    @property
    def wandb_id(self) -> Optional[str]:
        """The wandb run's id (saved with checkpoints so a resumed run continues it)."""
        return None if self.wandb_run is None else self.wandb_run.id

    def print(self, text: str) -> None:
        """A console line from rank 0 (clearing the progress bar first on a terminal)."""
        if not self.active:
            return
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def log(self, metrics: Dict[str, Any]) -> None:
        """Record one iteration's metrics (must hold ``iteration``)."""
        if not self.active:
            return
        it = metrics["iteration"]
        try:
            self._write_files(it, metrics)
        except OSError as err:  # a full disk: the trainer stops with a save (see io_error)
            self.io_error = self._io_failed(err)
        if self.wandb_run is not None:
            values = {k: v for k, v in metrics.items() if k != "iteration" and v is not None}
            self.wandb_run.log(values, step=it)
        if it == 1 or it % self.interval == 0 or it == self.total or \
                any(k.startswith("eval_loss") for k in metrics):
            self.print(format_line(metrics, self.total))
        if self.tty:
            self.stream.write("\r\033[K" + progress_bar(it, self.total, self.started, metrics.get("loss")))
            self.stream.flush()

    def _write_files(self, it: int, metrics: Dict[str, Any]) -> None:
        if self.metrics_fh is not None:
            row = clean_row(metrics)
            self.unwritten.append(row)  # until it is on disk (a failed write leaves part of it, or none)
            self.metrics_fh.write(json.dumps(row, allow_nan=False) + "\n")
            self.metrics_fh.flush()
            self.unwritten.pop()
        if self.tensorboard is not None:
            for k, v in metrics.items():
                if k != "iteration" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tensorboard.add_scalar(k, v, it)

    def _io_failed(self, err: OSError) -> str:
        """Stop writing the files (a failed flush is not retried) and say which one failed and why."""
        lc = self.cfg.logging
        where = f"--metrics-file {lc.metrics_file}" if self.metrics_fh is not None else \
            f"--tensorboard-dir {lc.tensorboard_dir}"
        for fh in (self.metrics_fh,):
            try:
                fh.close()
            except (OSError, AttributeError):
                pass
        self.metrics_fh, self.tensorboard = None, None
        return f"{where}: {(err.strerror or str(err)).lower()} (errno {err.errno})"

    def close(self) -> None:
        """Flush and close the metrics file and finish the wandb run."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
            self.tty = False
        try:
            if self.metrics_fh is not None:
                self.metrics_fh.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
        except OSError as err:
            self.io_error = self.io_error or self._io_failed(err)
        self.metrics_fh = self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
