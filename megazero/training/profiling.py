"""``--profile``: a trace of chosen training steps on chosen ranks, with Megatron-LM's flags.

``--profile-step-start S --profile-step-end E`` counts as Megatron-LM does: profiling starts when
``S`` iterations are done and stops when ``E`` are, so it covers the logged iterations ``S + 1 ..
E`` (defaults 10 and 12: iterations 11 and 12).  Each rank of ``--profile-ranks`` (default 0)
writes ``trace_rank<R>_iters<S+1>-<E>.json``, a Chrome/Perfetto trace of ``torch.profiler`` (CPU
activity, plus CUDA kernels on a GPU), into ``--profile-dir`` (default ``--tensorboard-dir``, else
``./profile``).  Slices that Perfetto would drop for crossing others on their thread's track (gloo's
point-to-point work) go to a track of their own (:mod:`megazero.training.trace_lanes`).  On a GPU
without ``--use-pytorch-profiler`` it instead opens a CUDA profiler capture range for ``nsys
profile --capture-range=cudaProfilerApi``, as Megatron-LM does.  A run that stops inside the window
(a signal, ``--exit-interval``) writes what it profiled.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

import torch

from megazero.training.trace_lanes import separate_crossing_slices


def profile_dir(logging_cfg) -> str:
    """Where traces go: ``--profile-dir``, else ``--tensorboard-dir``, else ``./profile``."""
    return logging_cfg.profile_dir or logging_cfg.tensorboard_dir or "profile"


def trace_path(logging_cfg, rank: int) -> str:
    """The trace file of ``rank``."""
    first, last = logging_cfg.profile_step_start + 1, logging_cfg.profile_step_end
    return os.path.join(profile_dir(logging_cfg), f"trace_rank{rank}_iters{first}-{last}.json")


def startup_line(logging_cfg, device: torch.device, train_iters: int) -> Optional[str]:
    """The one start-up line that says what is profiled and where it goes (None without --profile)."""
    lg = logging_cfg
    if not lg.profile:
        return None
    first, last = lg.profile_step_start + 1, lg.profile_step_end
    ranks = " ".join(map(str, lg.profile_ranks))
    if first > train_iters:
        return (f"--profile: nothing to profile: iteration {first} is past --train-iters {train_iters}; "
                "lower --profile-step-start")
    if _uses_nsys(lg, device):
        return (f"--profile: CUDA profiler capture range over iterations {first}-{last} on ranks {ranks} "
                "(run under nsys profile --capture-range=cudaProfilerApi; --use-pytorch-profiler for a "
                "torch.profiler trace)")
    return (f"--profile: torch.profiler trace of iterations {first}-{last} on ranks {ranks} -> "
            f"{trace_path(lg, lg.profile_ranks[0]).replace(f'rank{lg.profile_ranks[0]}', 'rank<R>')}")


def _uses_nsys(logging_cfg, device: torch.device) -> bool:
    return device.type == "cuda" and not logging_cfg.use_pytorch_profiler


class StepProfiler:
    """Starts and stops the profiler around the training loop's steps on this rank.

    Call :meth:`before` with the iteration about to run and :meth:`after` with the one just done;
    :meth:`close` at the end of the loop (also on an early stop) writes a trace still open.
    """

    def __init__(self, logging_cfg, rank: int, device: torch.device):
        lg = logging_cfg
        self.on = bool(lg.profile) and rank in lg.profile_ranks
        self.start, self.end = lg.profile_step_start, lg.profile_step_end
        self.nsys = _uses_nsys(lg, device)
        self.path = trace_path(lg, rank)
        self.activities: List = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._running = None  # the torch.profiler.profile, or the nvtx context under nsys
        self._label = None  # the open "iteration N" range

    def before(self, iteration: int) -> None:
        """``iteration`` (1-based) is about to run: start when ``start`` iterations are done (or, in a
        run resumed inside the window, at its first iteration)."""
        if not self.on or not self.start < iteration <= self.end:
            return
        if self._running is None:
            if self.nsys:
                torch.cuda.profiler.start()
                self._running = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            else:
                self._running = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self._running.__enter__()
        self._label = torch.profiler.record_function(f"iteration {iteration}")
        self._label.__enter__()

    def after(self, iteration: int) -> Optional[str]:
        """``iteration`` is done: stop and write the trace once ``end`` iterations are; returns the
        trace's path when this call wrote it."""
        self._close_label()
        if self._running is not None and iteration >= self.end:
            return self.close()
        return None

    def _close_label(self) -> None:
        label, self._label = self._label, None
        if label is not None:
            label.__exit__(None, None, None)

    def close(self) -> Optional[str]:
        """Stop the profiler if it runs and write its trace (nothing when it never started); returns
        the trace's path when it wrote one."""
        self._close_label()
        running, self._running = self._running, None
        if running is None:
            return None
        running.__exit__(None, None, None)
        if self.nsys:
            torch.cuda.profiler.stop()
            return None
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.tmp"
        running.export_chrome_trace(tmp)
        with open(tmp) as f:
            trace = json.load(f)
        separate_crossing_slices(trace)  # else Perfetto drops them (gloo's point-to-point work)
        with open(tmp, "w") as f:
            json.dump(trace, f)
        os.replace(tmp, self.path)  # a reader never sees half a trace
        return self.path
