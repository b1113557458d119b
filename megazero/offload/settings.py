"""Where model state lives, from the flags: the optimizer tier, the parameter tier (ZeRO-3) and
the NVMe tunables, with the rules every combination must follow (checked at start-up by
:func:`megazero.config.validate`, each error naming the flag)."""
from __future__ import annotations

from megazero.offload.aligned import ALIGN

DEVICES = ("none", "cpu", "nvme")


def optimizer_device(par) -> str:
    """``none``, ``cpu`` or ``nvme``: ``--offload-optimizer-device``, or ``cpu`` for ``--offload-optimizer``
    (Megatron-LM's ``--optimizer-cpu-offload``)."""
    dev = getattr(par, "offload_optimizer_device", None)
    if dev is None:
        return "cpu" if par.offload_optimizer else "none"
    return dev


def param_device(par) -> str:
    """``none``, ``cpu`` or ``nvme`` (``--offload-param-device``)."""
    return getattr(par, "offload_param_device", None) or "none"


def _fraction(par) -> float:
    return float(getattr(par, "optimizer_offload_fraction", 1.0))


def check_offload(par) -> None:
    """Raise ValueError naming the flag unless the offload settings are a valid combination."""
    dev = optimizer_device(par)
    if par.offload_optimizer and getattr(par, "offload_optimizer_device", None) not in (None, "cpu"):
        raise ValueError(f"--offload-optimizer (= --offload-optimizer-device cpu) contradicts "
                         f"--offload-optimizer-device {par.offload_optimizer_device}; give one of them")
    if dev != "none" and par.zero_stage == 0:
        flag = "--offload-optimizer" if getattr(par, "offload_optimizer_device", None) is None \
            else f"--offload-optimizer-device {dev}"
        raise ValueError(f"{flag} needs --zero-stage 1, 2 or 3 (stage 0 keeps no sharded optimizer state)")
    frac = _fraction(par)
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be within [0, 1], got {frac}")
    pdev = param_device(par)
    if pdev != "none" and par.zero_stage != 3:
        raise ValueError(f"--offload-param-device {pdev} needs --zero-stage 3 (only stage 3 shards the "
                         f"parameters), got --zero-stage {par.zero_stage}")
    if pdev == "cpu":
        raise ValueError("--offload-param-device cpu is not implemented: ZeRO-3's parameter shards stay "
                         "on the run's device or go to a disk; use --offload-param-device nvme (with "
                         "--nvme-path), or none")
    if "nvme" in (dev, pdev) and not getattr(par, "nvme_path", None):
        flag = "--offload-optimizer-device nvme" if dev == "nvme" else "--offload-param-device nvme"
        raise ValueError(f"--nvme-path is required with {flag}: give a directory on a local disk with room "
                         "for the swap files")
    block = par.nvme_block_size
    if block <= 0 or block % ALIGN:
        raise ValueError(f"--nvme-block-size must be a positive multiple of {ALIGN} bytes, got {block}")
    if par.nvme_io_threads < 1:
        raise ValueError(f"--nvme-io-threads must be at least 1, got {par.nvme_io_threads}")
    if par.nvme_buffer_count < 2:
        raise ValueError(f"--nvme-buffer-count must be at least 2 (one read ahead), "
                         f"got {par.nvme_buffer_count}")
    if par.nvme_buffer_size < 3 * ALIGN:
        raise ValueError(f"--nvme-buffer-size must be at least {3 * ALIGN} bytes, got {par.nvme_buffer_size}")


def check_swap_dir(par) -> None:
    """Before the model is built: ``--nvme-path`` exists and is writable when a tier is on NVMe
    (the room it needs is checked against the swap files' exact sizes once they are known).
    Raises :class:`~megazero.offload.checks.NvmePathError`."""
    if "nvme" in (optimizer_device(par), param_device(par)):
        from megazero.offload.checks import check_nvme_path
        check_nvme_path(par.nvme_path, 0)
