"""What a training run reports: a console line, a progress bar, a metrics JSONL file, TensorBoard
and wandb.

Only global rank 0 writes.  :class:`TrainingLogger.log` takes one dict per iteration (the
trainer's metrics) and sends the same values everywhere:

* ``--metrics-file``: one JSON object per iteration, every value as given, appended; a run that
  starts after iteration K (a resumed checkpoint's) first drops the file's rows after K, so each
  iteration appears once;
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
from typing import Any, Dict, Optional, TextIO


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
    if "eval_loss" in m:
        parts.append(f"eval loss {m['eval_loss']:.4f} (ppl {m['eval_ppl']:.2f})")
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


def trim_metrics_file(path: str, last_iteration: int) -> int:
    """Drop the rows of ``path`` after ``last_iteration`` (written by a run that went on past the
    checkpoint it is resumed from, or by an earlier run of a fresh start), so that each iteration
    appears once once this run appends its own; returns how many were dropped.  Lines that are not
    JSON objects with an ``iteration`` are kept; the file is replaced atomically."""
    if not os.path.isfile(path):
        return 0
    with open(path) as fh:
        lines = fh.readlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if (isinstance(row, dict) and isinstance(row.get("iteration"), int)
                and row["iteration"] > last_iteration):
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            fh.writelines(kept)
        os.replace(tmp, path)
    return len(lines) - len(kept)


class TrainingLogger:
    """Console, progress bar, metrics file, TensorBoard and wandb for one run (only rank 0 writes).

    ``start_iteration``: the iteration the run starts after (a resumed checkpoint's, else 0): the
    metrics file keeps its rows up to it and this run appends.  ``wandb_id``: the wandb run to
    continue (stored in the checkpoint), when there is one."""

    def __init__(self, cfg, rank: int = 0, stream: Optional[TextIO] = None, start_iteration: int = 0,
                 wandb_id: Optional[str] = None):
        self.cfg, self.active = cfg, rank == 0
        self.stream = stream if stream is not None else sys.stdout
        self.interval = max(1, cfg.logging.log_interval)
        self.total = cfg.training.train_iters
        self.tty = self.active and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.monotonic()
        self.metrics_fh = self.wandb_run = self.tensorboard = None
        self.dropped_rows = 0
        self.io_error: Optional[str] = None  # a metrics file or TensorBoard write failed (rank 0): why
        if not self.active:
            return
        lc = cfg.logging
        if lc.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(lc.metrics_file)), exist_ok=True)
            self.dropped_rows = trim_metrics_file(lc.metrics_file, start_iteration)
            self.metrics_fh = open(lc.metrics_file, "a")
        if lc.tensorboard_dir:
            self.tensorboard = tensorboard_writer_class()(log_dir=lc.tensorboard_dir)
        if lc.wandb_project and wandb_mode(lc.wandb_mode) != "disabled":
            self.wandb_run = self._start_wandb(wandb_id)

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
        if it == 1 or it % self.interval == 0 or it == self.total or "eval_loss" in metrics:
            self.print(format_line(metrics, self.total))
        if self.tty:
            self.stream.write("\r\033[K" + progress_bar(it, self.total, self.started, metrics.get("loss")))
            self.stream.flush()

    def _write_files(self, it: int, metrics: Dict[str, Any]) -> None:
        if self.metrics_fh is not None:
            # strict JSON: a non-finite value (the grad norm of a skipped fp16 step) becomes null
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in metrics.items()}
            self.metrics_fh.write(json.dumps(clean, allow_nan=False) + "\n")
            self.metrics_fh.flush()
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
