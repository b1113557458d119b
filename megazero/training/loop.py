"""The trainer: composes the mesh, a model, the ZeRO optimizer and the pipeline executor.

One iteration, on every rank:

1. learning rate from the schedule (:mod:`megazero.training.lr`);
2. ``optimizer.zero_grad()``; this data-parallel rank's micro-batches of the global batch, the next
   ``G`` samples of the one sample order (:func:`megazero.data.micro_batches`: the same samples at
   every layout; ``G`` follows :mod:`megazero.config.batch_schedule` with a batch-size schedule);
3. ``run_schedule``: forward and backward of every micro-batch through the pipeline, the
   optimizer acting as the gradient-sync hook and supplying the loss scale;
4. ``optimizer.finish_grad_sync()`` and ``optimizer.step(lr)`` (clipping, loss-scale update,
   skipped steps);
5. the loss averaged over micro-batches and data-parallel ranks, taken from the last pipeline
   stage and shared with every rank (one all-reduce), then logged by rank 0.

Every ``--eval-interval`` iterations the model runs forward only on ``--eval-iters`` held-out
batches.  With ``--save`` a checkpoint is written every ``--save-interval`` iterations and at the
end; ``--load`` resumes from the latest one, written under any layout (:mod:`megazero.checkpoint`):
the iteration, the LR schedule (skipped iterations included), the data position (consumed
samples) and the loss scale continue (``--finetune``: the weights only, from iteration 0).  Rank 0
prints the config's start-up notes (ignored Megatron-LM flags ...) and the start-up summary
(:mod:`megazero.training.summary`: parameters, settings, data, tokenizer) and logs through
:class:`megazero.training.log.TrainingLogger`, which continues the metrics file from the start
iteration.  The engine never imports ``models``: callers pass ``model_provider(cfg, mesh)``
returning this rank's list of model chunks (one per virtual pipeline stage).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megazero.config import MegazeroConfig, validate
from megazero.data import build_data, micro_batches, stage_keys
from megazero.data.eval_sets import eval_plan, final_test
from megazero.data.loader import StepBatches
from megazero.offload.host_memory import host_malloc_policy, peak_rss_bytes, set_host_malloc
from megazero.planning.flops import device_peak_flops, hardware_flops_per_iteration, model_flops_per_iteration
from megazero.training.log import TrainingLogger
from megazero.training.mtp import mtp_step_metrics
from megazero.training.lr import lrs_at
from megazero.training.profiling import StepProfiler, startup_line as profile_startup_line
from megazero.mesh import ParallelMesh
from megazero.moe.step import finish_step
from megazero.optim.precision import apply_tf32, compute_dtype
from megazero.training.summary import stage_counts, startup_summary
from megazero.tensor_parallel.deferred import build_chunks, realize_rest
from megazero.tensor_parallel.rng import seed_default_generators

ModelProvider = Callable[[MegazeroConfig, ParallelMesh], List[torch.nn.Module]]


# ---- start-up ------------------------------------------------------------------------------
def init_distributed(device: Optional[torch.device] = None, timeout: Optional[timedelta] = None) -> bool:
    """Join the process group that torchrun (or SLURM + torchrun) describes in the environment, with
    ``timeout`` (``--distributed-timeout-minutes``; 10 minutes by default) and a store prefix per
    torchrun restart (:func:`megazero.resilience.join_process_group`).

    Does nothing for one process or when a group already exists; returns True when it created
    the group (the caller then destroys it).  The joining itself is
    :func:`megazero.resilience.init_distributed`'s, as for the engine."""
    from megazero.resilience import init_distributed as join
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    join(device, timeout)
    return True


def build_mesh(cfg: MegazeroConfig, device: Optional[torch.device] = None) -> ParallelMesh:
    """The mesh of the current process group (one process: :meth:`ParallelMesh.single`); every
    group gets ``--distributed-timeout-minutes``."""
    from megazero.resilience import timeout_of
    if dist.is_initialized() and dist.get_world_size() > 1:
        par = cfg.parallel
        return ParallelMesh.build(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                  par.rank_order, device, timeout=timeout_of(cfg),
                                  cp=par.context_parallel_size, ep=cfg.moe.expert_model_parallel_size,
                                  etp=cfg.moe.expert_tensor_parallel_size)
    return ParallelMesh.single(device)


# ---- one step ------------------------------------------------------------------------------
def _mean_loss(losses: Sequence, mesh: ParallelMesh) -> float:
    """Average of the last stage's micro-batch losses over micro-batches and DP, on every rank (every
    CP rank holds the same, global, loss: one of them counts).  The sum stays on the device (a
    sequential float64 sum, as Python's) and is read once: one host sync for any number of
    micro-batches."""
    owner = mesh.is_last_stage and mesh.coord("tp") == 0 and mesh.coord("cp") == 0
    on = mesh.collective_device
    if owner and losses:
        local = torch.stack([x.reshape(()) for x in losses]).double().cumsum(0)[-1] / len(losses)
        local = local.to(on)
    else:
        local = torch.zeros((), dtype=torch.float64, device=on)
    if not mesh.is_distributed:
        return local.item()
    value = (local / mesh.size("dp")).reshape(1) if owner else local.reshape(1)
    dist.all_reduce(value, group=mesh.world_group)
    return value.item()


def _forward_backward(chunks, batches, mesh, cfg, optimizer=None, forward_only=False):
    """Run the pipeline schedule on ``batches``; returns the last stage's micro-batch losses."""
    from megazero.pipeline.executor import run_schedule
    from megazero.pipeline.p2p import p2p_tensor_shape
    scale = float(optimizer.loss_scale) if optimizer is not None else 1.0
    return run_schedule(chunks, mesh, batches, schedule=cfg.parallel.pipeline_schedule,
                        num_micro_batches=len(batches), tensor_shape=p2p_tensor_shape(cfg),
                        dtype=compute_dtype(cfg), grad_sync=optimizer, loss_scale=scale,
                        forward_only=forward_only, delay_wgrad=cfg.parallel.delay_wgrad_compute)


def evaluate(chunks, data, mesh: ParallelMesh, cfg: MegazeroConfig, split: str = "valid",
             iters: Optional[int] = None) -> float:
    """Mean loss over ``iters`` (default ``--eval-iters``) held-out batches of ``split`` (forward only,
    dropout off)."""
    tr = cfg.training
    for c in chunks:
        c.eval()
    losses, keys = [], stage_keys(chunks)  # the first stage reads tokens, the last labels and mask
    with torch.no_grad():
        for k in range(tr.eval_iters if iters is None else iters):
            batches = micro_batches(data, k, tr.global_batch_size, tr.micro_batch_size, mesh.coord("dp"),
                                    mesh.size("dp"), split=split, device=mesh.device, keys=keys)
            losses.append(_mean_loss(_forward_backward(chunks, batches, mesh, cfg, forward_only=True), mesh))
    for c in chunks:
        c.train()
    return sum(losses) / max(1, len(losses))


# ---- checkpoint hooks ----------------------------------------------------------------------
def _checkpoint_startup(ck, mesh: ParallelMesh, guard) -> Optional[int]:
    """Before training (collective): ``--save`` must be writable (probed now, not at the first save)
    and this run its only writer (the directory's lock, held until ``guard`` closes); ``--load`` is
    resolved once, by global rank 0.  Returns the iteration to resume from, or None: no ``--load``, or
    a ``--load`` directory without a checkpoint yet (``--save DIR --load DIR`` before the first save,
    Megatron's auto-resume pattern; or any other, where Megatron-LM too warns and starts from random),
    which ``--exit-on-missing-checkpoint`` makes an error."""
    from megazero.checkpoint import CheckpointError, check_save_dir, resume_iteration
    if ck.save:
        guard.save_lock = check_save_dir(ck.save, mesh)
    it = resume_iteration(ck.load, mesh, ck.ckpt_step) if ck.load else None
    if ck.load and it is None and ck.exit_on_missing_checkpoint:  # every rank: the answer is rank 0's
        raise CheckpointError(f"--exit-on-missing-checkpoint: no checkpoint in --load {ck.load}; check the "
                              "path, "
                              "or drop the flag to start from scratch")
    return it


def _no_checkpoint_line(ck) -> str:
    """What rank 0 says when ``--load`` holds no checkpoint (yet)."""
    start = ("fine-tuning from --pretrained-checkpoint" if ck.pretrained_checkpoint
             else "starting from scratch")
    if ck.save and os.path.realpath(ck.save) == os.path.realpath(ck.load):
        return f"no checkpoint in {ck.load} yet (it is also --save): {start}"
    what = "no such directory" if not os.path.exists(ck.load) else "it holds no checkpoint"
    return (f"megazero: WARNING: --load {ck.load}: {what}; {start}, as Megatron-LM does "
            "(--exit-on-missing-checkpoint makes this an error)")


def _resume(chunks, optimizer, mesh: ParallelMesh, cfg: MegazeroConfig, schedule):
    """``--load``: returns (iteration, skipped iterations, samples consumed, samples the learning-rate
    schedule has counted, the checkpoint's ``extra`` (wandb run id, metrics rows not written), the
    line to print)."""
    from megazero.config.batch_schedule import consumed_after
    from megazero.checkpoint import CheckpointError, load
    ck = cfg.checkpoint
    # --ckpt-step: exactly that iteration; else the newest usable one (a corrupt newest falls back)
    info = load(ck.load, chunks, optimizer, mesh, cfg, iteration=ck.ckpt_step)
    it, extra, gbs = info["iteration"], info["extra"], cfg.training.global_batch_size
    consumed = int(extra.get("consumed_samples", consumed_after(schedule, it)))
    skipped = int(extra.get("skipped_iterations", 0))
    lr_samples = int(extra.get("lr_samples", (it - skipped) * gbs))  # older checkpoints: a constant batch
    if len(schedule) == 1 and consumed % gbs:
        raise CheckpointError(f"{info['path']}: {consumed} consumed samples is not a multiple of "
                              f"--global-batch-size {gbs}; resume with a global batch size that divides it")
    lay = info["layout"]
    if ck.finetune:
        what = f"weights of iteration {info['saved_iteration']} for fine-tuning from iteration 0"
    else:
        what = f"iteration {it}, {consumed} samples"
    fresh = "" if info["optimizer_loaded"] else "; fresh optimizer"
    rng = "restored" if info["rng_restored"] else ("from --seed" if ck.finetune else "reseeded")
    experts = f" ep {lay['ep']} etp {lay['etp']}" if "ep" in lay else ""
    line = (f"loaded checkpoint {info['path']} ({what}; saved under tp {lay['tp']} pp {lay['pp']} "
            f"dp {lay['dp']}{experts} zero {lay['zero_stage']}{fresh}; RNG {rng}) in "
            f"{info['seconds']:.2f} s")
    line = "\n".join([f"warning: {w}" for w in info.get("warnings", [])] + [line])
    return it, skipped, consumed, lr_samples, extra, line


def _memory_metrics(optimizer, mesh: ParallelMesh) -> Dict[str, float]:
    out = {k: v for k, v in dict(optimizer.memory_bytes()).items()}
    out["peak_rss_bytes"] = peak_rss_bytes()
    if mesh.device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(mesh.device)
    return out


# ---- the loop ------------------------------------------------------------------------------
def train(cfg: MegazeroConfig, model_provider: ModelProvider, mesh: Optional[ParallelMesh] = None,
          stream=None, keep_history: bool = True) -> List[Dict[str, float]]:
    """Train for ``--train-iters`` steps; returns every iteration's metrics (on every rank), or an empty
    list with ``keep_history=False`` (the command line: the rows are streamed to the logger and the
    metrics file only, so memory does not grow with the number of iterations).

    Without ``mesh`` the mesh is built from the current process group (joined from the torchrun
    environment when there is none yet) or is a single process.
    """
    from megazero.resilience import timeout_of
    created = False
    if mesh is None:
        created = init_distributed(timeout=timeout_of(cfg))
        world = dist.get_world_size() if dist.is_initialized() else 1
        cfg = validate(cfg, world)
        mesh = build_mesh(cfg)
    else:
        cfg = validate(cfg, mesh.world_size)
    try:
        history = _train_loop(cfg, model_provider, mesh, stream, keep_history)
        if created:
            dist.barrier()  # no rank tears down its groups while another still uses them
        return history
    finally:
        if created:
            dist.destroy_process_group()


def _train_loop(cfg: MegazeroConfig, model_provider: ModelProvider, mesh: ParallelMesh, stream,
                keep_history: bool = True) -> List[dict]:
    """:func:`_guarded_loop` under a :class:`~megazero.resilience.RunGuard`: signal handlers and the
    heartbeat for its duration, a broken collective explained in one message."""
    from megazero.resilience import RunGuard
    with RunGuard(cfg, mesh) as guard:
        return _guarded_loop(cfg, model_provider, mesh, stream, guard, keep_history)


def _iteration_metrics(it: int, consumed: int, loss: float, lr: float, stats: Dict[str, object],
                       skipped_total: int, elapsed: float, optimizer, mesh: ParallelMesh,
                       rates) -> Dict[str, object]:
    """One iteration's metrics row; ``rates``: (tokens, model FLOPs, hardware FLOPs per iteration,
    the device's peak FLOP/s or None)."""
    tokens, model_flops, hw_flops, peak = rates
    grad_norm = stats.get("grad_norm")
    m = {"iteration": it, "consumed_samples": consumed, "loss": loss, "lr": lr,
         "grad_norm": None if grad_norm is None else float(grad_norm),
         "loss_scale": float(stats.get("loss_scale", optimizer.loss_scale)),
         "skipped": int(bool(stats.get("skipped", False))), "skipped_total": skipped_total,
         "iteration_time": elapsed, "tokens_per_sec": tokens / elapsed,
         "tflops": model_flops / elapsed / mesh.world_size / 1e12,
         "hw_tflops": hw_flops / elapsed / mesh.world_size / 1e12}
    if peak:
        m["mfu"] = model_flops / elapsed / mesh.world_size / peak
    m.update(_memory_metrics(optimizer, mesh))
    return m


@dataclass
class Position:
    """Where training stands: the last iteration done, samples consumed, iterations skipped (fp16
    overflows) and samples the learning-rate schedule has counted (those of the steps taken)."""
    iteration: int = 0
    consumed: int = 0
    skipped: int = 0
    lr_samples: int = 0

    def saved(self):
        return self.consumed, self.skipped, self.lr_samples


def _startup(cfg: MegazeroConfig, model_provider: ModelProvider, mesh: ParallelMesh, stream, guard):
    """Model, optimizer, data, the resumed position and the logger (with the start-up lines printed)."""
    from megazero.config.batch_schedule import schedule_of
    from megazero.zero import build_optimizer
    if cfg.checkpoint.load:  # a Megatron-LM checkpoint is converted first (megazero.checkpoint.megatron)
        from megazero.training.megatron_import import import_for_load
        cfg = import_for_load(cfg, model_provider, mesh)
    tr, ck = cfg.training, cfg.checkpoint
    resume_from = _checkpoint_startup(ck, mesh, guard)  # fails before any training
    set_host_malloc(host_malloc_policy(cfg, mesh.device.type))  # --host-malloc
    seed_default_generators(tr.seed, mesh)
    apply_tf32(cfg.precision, mesh.device)  # --tf32 (CUDA only)
    # built without memory where the model allows: the optimizer initialises it bucket by bucket
    chunks = build_chunks(model_provider, cfg, mesh, compute_dtype(cfg))
    for c in chunks:
        c.train()
    optimizer = build_optimizer(chunks, mesh, cfg)
    realize_rest(chunks, mesh.device, compute_dtype(cfg))
    data = build_data(cfg)
    schedule = schedule_of(tr, cfg.model.seq_length, tr.global_batch_size)
    pos, extra, loaded = Position(), {}, None
    if ck.load and resume_from is not None:
        it, skipped, consumed, lr_samples, extra, loaded = _resume(chunks, optimizer, mesh, cfg, schedule)
        pos = Position(it, consumed, skipped, lr_samples)
        guard.good = f"iteration {it} in {ck.load}"
    elif ck.pretrained_checkpoint:  # nothing of the fine-tune's own yet: the pretrained weights
        pretrained = replace(cfg, checkpoint=replace(ck, load=ck.pretrained_checkpoint, finetune=True,
                                                     ckpt_step=None))
        loaded = _resume(chunks, optimizer, mesh, pretrained, schedule)[-1]
    logger = TrainingLogger(cfg, mesh.rank, stream, start_iteration=pos.iteration,
                            wandb_id=extra.get("wandb_run_id"), missed_rows=extra.get("metrics_rows", ()))
    for note in cfg.notes:
        logger.print(f"megazero: {note}")
    for line in startup_summary(cfg, data, stage_counts(chunks, mesh), mesh.rank):
        logger.print(f"megazero: {line}")
    axes = ("tp", "cp", "pp", "dp") if mesh.size("cp") > 1 else ("tp", "pp", "dp")
    sizes = " ".join(f"{a} {mesh.size(a)}" for a in axes)
    logger.print(f"megazero: {mesh.describe()} | {sizes} "
                 f"zero {cfg.parallel.zero_stage} | {tr.num_micro_batches} micro-batches of "
                 f"{tr.micro_batch_size} per DP rank | {model_flops_per_iteration(cfg) / 1e12:.3g} model "
                 "TFLOP "
                 "per iteration")
    if ck.load and resume_from is None:
        logger.print(_no_checkpoint_line(ck))
    if loaded:
        logger.print(loaded)
    profiling = profile_startup_line(cfg.logging, mesh.device, tr.train_iters)
    if profiling:
        logger.print(f"megazero: {profiling}")
    if logger.dropped_rows:
        logger.print(f"{cfg.logging.metrics_file}: dropped {logger.dropped_rows} rows after iteration "
                     f"{pos.iteration} (written by an earlier run); this run's rows follow")
    return chunks, optimizer, data, schedule, pos, logger


def _step(cfg: MegazeroConfig, chunks, optimizer, data, mesh: ParallelMesh, pos: Position, batch: int, work,
          skip_if=None):
    """One training iteration of ``batch`` samples from ``pos`` (advanced in place); returns the
    metrics row (timing, throughput and memory included), the optimizer's stats and the loss.
    ``work``: (model FLOPs, hardware FLOPs) of a full global batch and the device's peak FLOP/s.
    ``skip_if(loss)``: asked before the update with the loss agreed over the world (a spike is
    skipped, ``--loss-spike-action skip``); the update is not applied when it says True."""
    tr = cfg.training
    start = time.perf_counter()
    lr, decoupled_lr = lrs_at(cfg, pos.lr_samples)  # skipped steps do not advance the schedule
    io_before = optimizer.io_counts()
    optimizer.zero_grad()
    batches = data.get(pos.consumed, batch)  # data: a StepBatches (this stage's tensors, prefetched)
    losses = _forward_backward(chunks, batches, mesh, cfg, optimizer)
    if pos.iteration + 1 < tr.train_iters:  # the device computes: the host reads the next batch
        data.ahead(pos.consumed + batch)
    optimizer.finish_grad_sync()
    moe = finish_step(chunks, mesh, cfg, len(batches))  # MoE routers: records reduced, expert biases moved
    moe.update(mtp_step_metrics(chunks, mesh, cfg, len(batches)))  # multi-token prediction's losses
    if skip_if is not None:  # the loss first (a collective): every rank decides alike
        loss = _mean_loss(losses, mesh)
        stats = optimizer.step(lr, decoupled_lr, skip=bool(skip_if(loss)))
    else:
        stats = optimizer.step(lr, decoupled_lr)
        loss = _mean_loss(losses, mesh)  # also synchronises the ranks before timing
    if mesh.device.type == "cuda":
        torch.cuda.synchronize(mesh.device)
    elapsed = time.perf_counter() - start
    skipped = bool(stats.get("skipped", False))
    pos.iteration, pos.consumed = pos.iteration + 1, pos.consumed + batch
    pos.skipped, pos.lr_samples = pos.skipped + int(skipped), pos.lr_samples + (0 if skipped else batch)
    share = batch / tr.global_batch_size  # of a full batch's work (batch-size ramp-up)
    rates = (batch * cfg.model.seq_length, work[0] * share, work[1] * share, work[2])
    m = _iteration_metrics(pos.iteration, pos.consumed, loss, lr, stats, pos.skipped, elapsed, optimizer,
                           mesh, rates)
    m.update(moe)
    if io_before is not None:  # the NVMe tier's traffic in this iteration
        io = optimizer.io_counts() - io_before
        m.update(io_read_bytes=io.bytes_read, io_write_bytes=io.bytes_written, io_wait_s=io.wait_seconds,
                 io_busy_s=io.busy_seconds)
    if decoupled_lr is not None:
        m["decoupled_lr"] = decoupled_lr
    if tr.step_batch_size_schedule or tr.rampup_batch_size:
        m["global_batch_size"] = batch
    return m, stats, loss


def _guarded_loop(cfg: MegazeroConfig, model_provider: ModelProvider, mesh: ParallelMesh, stream,
                  guard, keep_history: bool = True) -> List[dict]:
    from megazero.config.batch_schedule import batch_size_at
    from megazero.resilience import NumericalError
    from megazero.training.saver import Saver
    tr, ck = cfg.training, cfg.checkpoint
    chunks, optimizer, data, schedule, pos, logger = _startup(cfg, model_provider, mesh, stream, guard)
    start_iter, history, saved_at = pos.iteration, [], None
    saver = Saver(cfg, chunks, optimizer, mesh, logger, guard) if ck.save else None
    loader = StepBatches(data, tr.micro_batch_size, mesh.coord("dp"), mesh.size("dp"), mesh.device,
                         stage_keys(chunks), lambda consumed: batch_size_at(schedule, consumed))
    work = (model_flops_per_iteration(cfg), hardware_flops_per_iteration(cfg),
            device_peak_flops(mesh.device, "fp32" if compute_dtype(cfg) == torch.float32 else "bf16"))
    profiler = StepProfiler(cfg.logging, mesh.rank, mesh.device)  # --profile
    try:
        for it in range(start_iter + 1, tr.train_iters + 1):
            guard.begin(it)
            batch = batch_size_at(schedule, pos.consumed)
            profiler.before(it)
            m, stats, loss = _step(cfg, chunks, optimizer, loader, mesh, pos, batch, work,
                                   guard.skip_spike if guard.spike.skips else None)
            written = profiler.after(it)
            if tr.eval_interval and (it % tr.eval_interval == 0 or it == tr.train_iters):
                for suffix, split, iters in eval_plan(data, cfg):  # megazero.data.eval_sets
                    m["eval_loss" + suffix] = evaluate(chunks, data, mesh, cfg, split, iters)
                    m["eval_ppl" + suffix] = math.exp(min(m["eval_loss" + suffix], 50.0))
            if it == tr.train_iters and final_test(data, cfg):  # --test-data-path: once, at the end
                m["test_loss"] = evaluate(chunks, data, mesh, cfg, *final_test(data, cfg))
                m["test_ppl"] = math.exp(min(m["test_loss"], 50.0))
            logger.log(m)
            if written:
                logger.print(f"megazero: --profile: wrote {written} (open it in Perfetto, ui.perfetto.dev)")
            if keep_history:
                history.append(m)
            try:  # NaN/inf or a spike: raises, nothing saved from it, the pending save set aside
                guard.check_step(it, loss, stats, optimizer.scaler.dynamic)
            except NumericalError as err:
                note = saver.reject() if saver is not None else None
                raise NumericalError(f"{err} {note}" if note else str(err)) from None
            spiked = guard.spike.skipped  # a skipped spike: no confirmation and no save from it
            if saver is not None and not spiked:
                saver.confirm()  # this loss came from the pending save's weights: it becomes the latest
            if ck.save and ck.save_interval and it % ck.save_interval == 0 and not spiked:
                saver.save(it, pos.saved())
                saved_at = it
            # signal, --exit-duration-in-mins, --exit-interval, a full metrics disk: every rank alike
            stop = guard.stop_reason(it, logger.io_error)
            if stop:
                guard.stopping()  # from here a repeated signal counts towards the grace period
                logger.print(f"stopping after iteration {it}: {stop}" + ("" if ck.save else " (no --save)"))
                break
        optimizer.finish_param_sync()  # the last step's overlapped parameter all-gathers (stages 1/2)
        if saver is not None and pos.iteration > start_iter and saved_at != pos.iteration:
            saver.save(pos.iteration, pos.saved(), final=True)
        if saver is not None:
            saver.close()  # the run ends: what is pending (its loss was checked) is published
        if guard.stop.failed:  # a write outside the save failed: the run saved and now fails
            from megazero.resilience import FatalError
            saved = f"saved checkpoint at iteration {pos.iteration} in {ck.save}" if ck.save else "no --save"
            raise FatalError(f"{logger.io_error or 'rank 0 could not write its metrics'} at iteration "
                             f"{pos.iteration}; stopped with an emergency save ({saved}): free space, then "
                             "resume with --load")
    except BaseException:
        if saver is not None:
            saver.abandon()
        raise
    finally:
        profiler.close()  # a run stopped inside the window writes what it profiled
        logger.close()
        optimizer.close()  # the NVMe swap file is scratch: removed at exit (a crash leaves it for reuse)
    return history
