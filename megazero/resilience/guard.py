"""The trainer's one companion for operations: :class:`RunGuard`.

Used as ``with RunGuard(cfg, mesh) as guard:`` around the whole training loop, it

* installs the ``--exit-signal-handler`` handlers and starts the heartbeat on entry, and on exit
  (normal or not) stops the heartbeat thread and restores the handlers, before the process group
  is destroyed: no thread of ours outlives the groups;
* turns a collective that timed out or lost its peer into one :class:`CollectiveError` message
  naming the operation, the group and the silent ranks (:mod:`megazero.resilience.watchdog`);
* per iteration: :meth:`begin` (progress for the heartbeat, fault injection), :meth:`check_step`
  (NaN/inf, :mod:`megazero.resilience.numerics`) and :meth:`stop_reason` (signal, duration,
  interval, agreed over the world: :mod:`megazero.resilience.stop`).
"""
from __future__ import annotations

from typing import Optional

from megazero.resilience.errors import CollectiveError, NumericalError
from megazero.resilience.faults import FaultInjector
from megazero.resilience.numerics import LossSpikeGuard, NanGuard
from megazero.resilience.signals import ExitSignals
from megazero.resilience.stop import StopConditions
from megazero.resilience.watchdog import Heartbeat, default_store, describe_failure, failure_kind, timeout_of


def _precision_name(cfg) -> str:
    return "bf16" if cfg.precision.bf16 else "fp16" if cfg.precision.fp16 else "fp32"


def heartbeat_interval(timeout_seconds: float) -> float:
    """Seconds between heartbeats: a sixth of the timeout, within [0.5, 30]."""
    return min(30.0, max(0.5, timeout_seconds / 6.0))


class RunGuard:
    """Signals, heartbeat, NaN checks and stop conditions for one training run (see the module)."""

    def __init__(self, cfg, mesh):
        res = cfg.resilience
        self.cfg, self.mesh = cfg, mesh
        self.timeout = timeout_of(cfg)
        grace = res.exit_signal_grace_secs
        self.signals = ExitSignals(res.exit_signal, grace) if res.exit_signal_handler else None
        watch_io = bool(cfg.logging.metrics_file or cfg.logging.tensorboard_dir)
        self.stop = StopConditions(res, self.signals, watch_io=watch_io)
        self.res_cfg = res
        self.nan: Optional[NanGuard] = None
        self.spike = LossSpikeGuard(res.loss_spike_factor, res.loss_spike_window, res.loss_spike_action,
                                    res.loss_spike_max_skips)
        self.good: Optional[str] = None  # the newest checkpoint known good ("iteration N in DIR"), for advice
        self.faults = FaultInjector(mesh.rank)
        self.heartbeat: Optional[Heartbeat] = None
        self.save_lock = None  # the --save directory's lock (megazero.checkpoint.SaveLock), released on close

    def __enter__(self) -> "RunGuard":
        if self.signals is not None:
            self.signals.install()
        store = default_store() if self.mesh.is_distributed else None
        if store is not None:
            interval = heartbeat_interval(self.timeout.total_seconds())
            self.heartbeat = Heartbeat(store, self.mesh.rank, interval)
            try:
                self.heartbeat.start()
            except Exception:  # noqa: BLE001 - diagnosis is optional, training is not
                self.heartbeat = None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            kind = failure_kind(exc) if exc is not None and self.mesh.is_distributed else None
            if kind is not None:
                message = describe_failure(exc, kind, self.mesh, self.heartbeat, self.timeout)
                raise CollectiveError(message) from exc
        finally:
            self.close()

    def close(self) -> None:
        """Release the --save lock, stop the heartbeat thread, restore the signal handlers (idempotent)."""
        if self.save_lock is not None:
            self.save_lock.release()
            self.save_lock = None
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.signals is not None:
            self.signals.restore()

    # ---- per iteration ------------------------------------------------------------------------
    def phase(self, name: str, iteration: Optional[int] = None) -> None:
        """What this rank is doing now (shown to the peers that diagnose a failure)."""
        if self.heartbeat is not None:
            self.heartbeat.mark(iteration, name)

    def begin(self, iteration: int) -> None:
        self.phase("forward-backward", iteration)
        self.faults(iteration)

    def skip_spike(self, loss: Optional[float]) -> bool:
        """``--loss-spike-action skip``: True when ``loss`` (agreed over the world, before the update)
        is a spike, so that the update is not applied; :meth:`check_step` counts it."""
        return self.spike.skips and self.spike.over(loss) is not None

    def check_step(self, iteration: int, loss: Optional[float], stats: dict, dynamic_scaler: bool) -> bool:
        """NaN/inf check after the step; True when the step was non-finite (it was not applied).
        Raises :class:`NumericalError` beyond ``--skip-nan-steps``, and at a loss spike (with
        ``--loss-spike-action skip``: beyond ``--loss-spike-max-skips`` in a row; ``spike.skipped``
        says whether this iteration's spike was skipped)."""
        if self.nan is None:
            self.nan = NanGuard(self.res_cfg, dynamic_scaler, _precision_name(self.cfg))
        grad_norm = stats.get("grad_norm")
        try:
            spiked = bool(stats.get("spike", False))  # not a numerical skip: the NaN guard ignores it
            bad = self.nan.check(iteration, loss, None if grad_norm is None else float(grad_norm),
                                 bool(stats.get("skipped", False)) and not spiked,
                                 float(stats.get("loss_scale", 1.0)))
            self.spike.check(iteration, loss)
        except NumericalError as err:
            raise NumericalError(f"{err} {self.advice()}") from None
        return bad

    def advice(self) -> str:
        """Where to resume from after a divergence: the newest checkpoint known good."""
        if self.good is None:
            return "No checkpoint of this run is known good: start again from scratch (or your --load)."
        return (f"The last good checkpoint is {self.good} (its tracker names it: --load resumes from it; "
                "a checkpoint becomes the latest only once the next iteration's loss is finite and within "
                "the guard).")

    def stopping(self) -> None:
        """Every rank stops after this iteration and saves: repeated signals count towards the grace
        period from now (:class:`ExitSignals`)."""
        if self.signals is not None:
            self.signals.saving()
        self.phase("stopping")

    def stop_reason(self, iteration: int, io_error: Optional[str] = None) -> Optional[str]:
        """Why every rank stops after ``iteration`` (collective when signals, a duration or files to
        watch are set); ``io_error``: this rank's failed metrics write (an emergency save follows)."""
        self.phase("end of iteration", iteration)
        return self.stop.reason(iteration, self.mesh, io_error)
