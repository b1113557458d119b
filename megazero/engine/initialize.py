"""``initialize``: DeepSpeed's entry point, with DeepSpeed's meaning for every argument and result."""
from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megazero.engine.process_exit import report_uncaught_errors, tear_down_at_exit
from megazero.errors import ConfigError
from megazero.resilience import init_distributed as join


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True, timeout=None,
                     init_method: Optional[str] = None, dist_init_required=None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the default process group from the launcher's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``: torchrun or ``scripts/launch.py``); without one, a group of this
    process alone.  The backend is NCCL with a GPU, gloo otherwise, unless ``dist_backend`` says.  The
    groups are torn down at interpreter exit (:mod:`megazero.engine.process_exit`)."""
    report_uncaught_errors()
    if dist.is_initialized():
        return
    if rank >= 0 and world_size >= 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port or _free_port()))
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(minutes=timeout)
    join(backend=dist_backend, timeout=timeout, init_method=init_method)  # the trainer's way to join
    report_uncaught_errors()  # back in front of the excepthook torch installs there
    tear_down_at_exit()


def _config_source(args, config, config_params):
    """The ds_config: ``config`` (or its old name ``config_params``) or ``args.deepspeed_config``."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ConfigError("a ds_config was given twice, as initialize(config=...) and as "
                          "--deepspeed_config; give one")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("no ds_config: pass initialize(config=dict or path) or --deepspeed_config PATH")
    return config


def _mesh():
    from megazero.mesh import ParallelMesh
    if dist.is_initialized() and dist.get_world_size() > 1:
        return ParallelMesh.build()
    return ParallelMesh.single()


def _loader(data, config, mesh, collate_fn):
    """DeepSpeed's data loader: micro-batches of this rank's share (a ``DistributedSampler`` over the
    data-parallel ranks, shuffled with seed 0)."""
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler
    sampler = DistributedSampler(data, num_replicas=mesh.size("dp"), rank=mesh.coord("dp"))
    return DataLoader(data, batch_size=config.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=config.drop_last)


def _check_offload(par) -> None:
    """megazero's rules for the offload tiers, in ds_config terms."""
    from megazero.offload.settings import check_offload
    try:
        check_offload(par)
    except ValueError as err:
        raise ConfigError(f"ds_config zero_optimization: {err} (megazero's flag names; docs/engine.md "
                          "maps them to the ds_config keys)") from None


def initialize(args=None, model: Optional[torch.nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: Optional[int] = None, mpu=None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """Wrap ``model`` for training with megazero's ZeRO stages, mixed precision and offload, configured
    by a DeepSpeed ``ds_config`` (docs/engine.md).  Returns ``(engine, optimizer, dataloader,
    lr_scheduler)``: the :class:`~megazero.engine.engine.Engine`, the optimizer it steps (whose
    ``param_groups`` carry the learning rate), a loader of ``training_data`` (None without), and the
    schedule (the given one, built by calling it with the optimizer when it is a callable, else the
    ds_config's, else None).  Collective: every rank calls it.  A :class:`ConfigError` (a key it does not
    support, named) that the script does not catch ends it in one line with exit status 2."""
    report_uncaught_errors()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"initialize(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ConfigError("initialize(mpu=..., mesh_param=...): model parallelism is not supported by "
                          "megazero's engine (data parallelism over the whole world only)")
    source = _config_source(args, config, config_params)
    if dist_init_required is not False and not dist.is_initialized() and \
            int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        init_distributed(distributed_port=distributed_port)  # the hook and the tear-down with it
    elif dist.is_initialized():  # the script's own group
        report_uncaught_errors()
        tear_down_at_exit()
    mesh = _mesh()
    from megazero.engine.config import read_config
    from megazero.engine.engine import Engine
    from megazero.engine.optim import read_optimizer
    from megazero.engine.schedulers import build_scheduler
    client_lr = None
    if isinstance(optimizer, torch.optim.Optimizer):
        client_lr = float(optimizer.param_groups[0]["lr"])
    config = read_config(source, mesh.size("dp"), mesh.device.type, args, model, client_lr)
    _check_offload(config.megazero.parallel)
    if config.megazero.parallel.nvme_path:  # DeepSpeed creates the swap directory
        os.makedirs(config.megazero.parallel.nvme_path, exist_ok=True)
    groups, client = read_optimizer(model, optimizer, model_parameters, config.optimizer, config.megazero)
    engine = Engine(model, config, mesh, groups, client)
    if lr_scheduler is not None:
        if config.scheduler is not None:
            config.notes.append("ds_config scheduler: the lr_scheduler given to initialize() is used instead")
        scheduler = lr_scheduler(engine.optimizer) if callable(lr_scheduler) else lr_scheduler
    elif config.scheduler is not None:
        scheduler = build_scheduler(config.scheduler[0], config.scheduler[1], engine.optimizer)
    else:
        scheduler = None
    engine.lr_scheduler = scheduler
    if mesh.rank == 0:
        for note in config.notes:
            print(f"[megazero] {note}", flush=True)
    return engine, engine.optimizer, _loader(training_data, config, mesh, collate_fn), scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: ``--deepspeed`` and ``--deepspeed_config PATH`` (and their
    old names ``--deepscale`` / ``--deepscale_config``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (read by megazero's engine)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable the engine (accepted: megazero.initialize always runs it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="ds_config JSON file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
