"""What the planner plans for: GPUs, or CPU hosts whose ranks share the host.

:class:`Hardware` describes one rank's compute rate, memory, links and node.  Three kinds:

- a GPU type timed by shape (:meth:`Hardware.for_gpu`, :mod:`megazero.planning.gpu_model`), or at
  a flat efficiency of its peak; every GPU has its own memory;
- a CPU host (``device == "cpu"``): ``gpus_per_node`` ranks (processes) share its ``cores``, its
  memory and its disk.  ``memory_bytes`` is then the *host's* memory, which the planner holds the
  sum of its ranks' process memory to; the host's cores are divided among its ranks, so a rank
  computes at ``cores / ranks`` of a core's rate (``oversubscription`` = ranks per core above 1:
  8 ranks on 2 cores do the work of 2, not of 8); ``peak_flops`` is a rank's share of the cores'
  matmul peak, so MFU stays below the efficiency of a real layer;
- a CPU host calibrated by ``plan.py --calibrate`` (:meth:`Hardware.from_calibration`): the same,
  with the rates, links and disk measured on the machine instead of assumed.

``disk_bytes`` (CPU hosts): free space for the NVMe tiers' swap files of a host's ranks
(``None``: not checked); ``disk_bytes_per_s``: its bandwidth, shared by the host's ranks.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from typing import Dict, Optional

from megazero.errors import ConfigError
from megazero.process.threads import host_cores
from megazero.planning.gpu_model import GPU_TYPES, KNEE, GpuType, Link

GB = 1e9
# a node's disk for the NVMe offload tiers when nothing measured it (plan.py --calibrate does):
# assumed, one PCIe 4.0 NVMe drive with reads and writes mixed
DISK_BYTES_PER_S = 3.0e9
# name: (bf16 dense TFLOP/s, memory GB, intra-node GB/s per GPU per direction, inter-node GB/s per
# GPU, HBM GB/s): gpu_model.GPU_TYPES, where each figure's source is given
GPUS = {name: (g.peak_tflops, g.memory_gb, g.link_gbs, g.net_gbs, g.hbm_gbs) for name, g in GPU_TYPES.items()}
ALPHA_INTRA, ALPHA_INTER = 5e-6, 15e-6  # seconds per message (NCCL over NVLink / InfiniBand)
# Megatron-LM's --attention-backend -> the kernel the shape model times (and the memory model counts):
# flash and cuDNN's fused attention keep no s x s scores; unfused and Megatron's local (its own
# DotProductAttention) write and keep them
ATTENTION_KERNELS = {"auto": "flash", "flash": "flash", "fused": "flash", "unfused": "unfused",
                     "local": "unfused"}
# A CPU host nobody calibrated: assumed order-of-magnitude figures (plan.py --calibrate measures them)
CPU_CORE_FLOPS = 5e10          # fp32 FLOP/s of one core on a large matmul
CPU_EFFICIENCY = 0.5           # a real GPT layer's rate over that
CPU_MEMORY_BYTES_PER_S = 2e10  # the host's memory bandwidth (the optimizer step), shared by its ranks
CPU_LINK = Link(50e-6, 1 / 2e9)  # gloo between processes of one host: alpha s, beta s/byte
# dropout on one core, forward + backward: seconds per activation element, and extra seconds per
# attention score of causal SDPA with dropout (the math kernel); both measured once on an AMD EPYC
# (AVX-512) core alone, at hidden 256, head dim 64
CPU_DROPOUT_S = 7.8e-9
CPU_ATTENTION_DROPOUT_S = 9.3e-9


@dataclass(frozen=True)
class Hardware:
    peak_flops: float
    efficiency: float
    memory_bytes: float
    intra: Link
    inter: Link
    hbm_bytes_per_s: float
    gpus_per_node: int
    layer_overhead_s: float = 0.0  # per layer and micro-batch, forward + backward (calibrated)
    oversubscription: float = 1.0  # ranks sharing one processor (CPU ranks beyond the cores; 1 on GPUs)
    gpu: Optional[GpuType] = None  # compute by shape (gpu_model) instead of a flat efficiency
    attention: str = "flash"  # the attention kernel the shape model times: flash | unfused
    knee: float = KNEE
    disk_bytes_per_s: float = DISK_BYTES_PER_S  # a node's disk for NVMe offload, shared by its ranks
    device: str = "cuda"  # "cpu": memory_bytes is a host's, shared by its gpus_per_node ranks
    cores: Optional[int] = None  # a CPU host's cores
    disk_bytes: Optional[float] = None  # a CPU host's free disk for swap files (None: not checked)
    # a CPU rank's dropout, seconds per activation element and per attention score (0 on GPUs,
    # whose dropout is element-wise work at the memory's bandwidth, fused into flash attention)
    dropout_s: float = 0.0
    attention_dropout_s: float = 0.0

    @classmethod
    def for_gpu(cls, gpu: GpuType, gpus_per_node: int = 8, attention: str = "flash",
                knee: float = KNEE, memory_gb: Optional[float] = None) -> "Hardware":
        """A cluster of ``gpu``s timed by shape (:mod:`megazero.planning.gpu_model`)."""
        return cls(gpu.peak_tflops * 1e12, gpu.gemm_max, (memory_gb or gpu.memory_gb) * GB,
                   Link(gpu.alpha_intra, 1 / (gpu.link_gbs * GB * gpu.busbw)),
                   Link(gpu.alpha_inter, 1 / (gpu.net_gbs * GB * gpu.busbw)), gpu.hbm_gbs * GB,
                   gpus_per_node, gpu=gpu, attention=attention, knee=knee)

    @classmethod
    def cpu_host(cls, ranks_per_host: int, cores: int, memory_bytes: float, *,
                 calibration: Optional[Dict[str, object]] = None, disk_bytes: Optional[float] = None,
                 attention: str = "flash") -> "Hardware":
        """Hosts of ``cores`` cores and ``memory_bytes`` of memory, each running ``ranks_per_host``
        ranks (module docstring), with the constants of a ``plan.py --calibrate`` JSON or the
        assumed ones (``CPU_*``)."""
        share = cores / ranks_per_host  # of the host's cores, per rank
        sharing = max(1.0, ranks_per_host / cores)
        dropout = (CPU_DROPOUT_S * sharing, CPU_ATTENTION_DROPOUT_S * sharing)
        if calibration is None:
            core_peak, efficiency, overhead = CPU_CORE_FLOPS, CPU_EFFICIENCY, 0.0
            intra = inter = CPU_LINK
            disk_rate = DISK_BYTES_PER_S
        else:
            cal = calibration
            measured_sharing = max(1.0, float(cal.get("oversubscription", 1.0)))
            core_rate = cal["flops"] * measured_sharing  # a real layer on one core, alone
            core_peak = max(cal["core_flops"], core_rate)
            efficiency = core_rate / core_peak
            overhead = cal.get("layer_overhead_s", 0.0) / measured_sharing * sharing
            intra, inter = Link(*cal["intra"]), Link(*cal["inter"])
            disk_rate = cal.get("disk_bytes_per_s", DISK_BYTES_PER_S)
            if "dropout_s" in cal:  # measured at the calibration's sharing
                dropout = tuple(cal[k] / measured_sharing * sharing
                                for k in ("dropout_s", "attention_dropout_s"))
        return cls(core_peak * share, efficiency, memory_bytes, intra, inter,
                   CPU_MEMORY_BYTES_PER_S / ranks_per_host, ranks_per_host, overhead, sharing,
                   attention=attention, disk_bytes_per_s=disk_rate, device="cpu", cores=cores,
                   disk_bytes=disk_bytes, dropout_s=dropout[0], attention_dropout_s=dropout[1])

    @classmethod
    def from_calibration(cls, cal: Dict[str, object], memory_bytes: float, ranks_per_host: int,
                         cores: Optional[int] = None) -> "Hardware":
        """The host a ``plan.py --calibrate`` JSON describes, running ``ranks_per_host`` ranks on
        ``cores`` cores (default: the calibrated machine's)."""
        return cls.cpu_host(ranks_per_host, cores or int(cal["cores"]), memory_bytes, calibration=cal)


# ---- this machine ----------------------------------------------------------------------------
def host_memory_bytes() -> float:
    """This machine's physical memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def free_disk_bytes(path: Optional[str]) -> float:
    """Free bytes on the disk that holds ``path`` (its nearest existing ancestor; default: the
    temporary directory)."""
    path = os.path.abspath(path or tempfile.gettempdir())
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return float(shutil.disk_usage(path).free)


# ---- plan.py's flags -------------------------------------------------------------------------
GPU_FLAGS = ("--gpu", "--gpu-memory-gb", "--gpu-tflops", "--efficiency", "--intra-node-bandwidth",
             "--inter-node-bandwidth")
HOST_FLAGS = ("--host-cores", "--host-memory-gb", "--host-disk-gb")


def _given(args, names) -> list:
    return [n for n in names if getattr(args, n[2:].replace("-", "_")) is not None]


def default_device(args) -> str:
    """``--device`` when not given: ``cpu`` with a calibration or a ``--host-*`` flag, ``cuda`` with a
    ``--gpu*`` flag, else ``cuda`` where this machine has a GPU and ``cpu`` (this host) where not."""
    if args.device:
        return args.device
    if args.calibration or _given(args, HOST_FLAGS):
        return "cpu"
    if _given(args, GPU_FLAGS):
        return "cuda"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def from_args(args, nvme_path: Optional[str] = None) -> Hardware:
    """The :class:`Hardware` plan.py's flags describe (ConfigError naming a bad flag): GPUs of the
    ``--gpu`` type timed by shape, or at a flat ``--efficiency`` of peak; or, with ``--device cpu``
    (implied by ``--calibration``), hosts whose ranks share ``--host-cores``, ``--host-memory-gb``
    and ``--host-disk-gb`` (default: this machine's; the disk's free space under ``nvme_path``)."""
    for flag in GPU_FLAGS[1:] + HOST_FLAGS:
        v = getattr(args, flag[2:].replace("-", "_"))
        if v is not None and not v > 0:
            raise ConfigError(f"{flag} must be > 0, got {v}")
    if args.efficiency is not None and not args.efficiency <= 1:
        raise ConfigError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    if not 0 <= args.margin < 1:
        raise ConfigError(f"--margin must be in [0, 1), got {args.margin}")
    kernel = ATTENTION_KERNELS[args.attention_backend]
    if args.device == "cpu":
        return _cpu_from_args(args, kernel, nvme_path)
    if _given(args, HOST_FLAGS) or args.calibration:
        flag = (_given(args, HOST_FLAGS) or ["--calibration"])[0]
        raise ConfigError(f"{flag} describes a CPU host; it goes with --device cpu")
    name = args.gpu or "H100"
    if name not in GPU_TYPES:
        raise ConfigError(f"--gpu {name}: unknown GPU type; choose one of {', '.join(GPU_TYPES)}, or the "
                          "closest one with --gpu-tflops, --gpu-memory-gb and the bandwidths set to yours")
    base = GPU_TYPES[name]
    gpu = replace(base, peak_tflops=args.gpu_tflops or base.peak_tflops,
                  memory_gb=args.gpu_memory_gb or base.memory_gb,
                  link_gbs=args.intra_node_bandwidth or base.link_gbs,
                  net_gbs=args.inter_node_bandwidth or base.net_gbs,
                  alpha_intra=args.intra_node_latency_us * 1e-6,
                  alpha_inter=args.inter_node_latency_us * 1e-6)
    per_node = args.gpus_per_node or 8
    if args.efficiency is None:
        return Hardware.for_gpu(gpu, per_node, attention=kernel)
    return Hardware(gpu.peak_tflops * 1e12, args.efficiency, gpu.memory_gb * GB,
                    Link(gpu.alpha_intra, 1 / (gpu.link_gbs * GB)),
                    Link(gpu.alpha_inter, 1 / (gpu.net_gbs * GB)), gpu.hbm_gbs * GB, per_node,
                    attention=kernel)


def _cpu_from_args(args, kernel: str, nvme_path: Optional[str]) -> Hardware:
    if _given(args, GPU_FLAGS):
        raise ConfigError(f"{_given(args, GPU_FLAGS)[0]} describes a GPU; with --device cpu the ranks share "
                          "the host's memory and cores: give --host-memory-gb and --host-cores (default: "
                          "this machine's), or --calibration")
    cal = None
    if args.calibration:
        from megazero.planning.calibrate import load_calibration
        cal = load_calibration(args.calibration)
    memory = args.host_memory_gb * GB if args.host_memory_gb else host_memory_bytes()
    disk = args.host_disk_gb * GB if args.host_disk_gb else free_disk_bytes(nvme_path)
    per_host = min(args.gpus, args.gpus_per_node or args.gpus)
    return Hardware.cpu_host(per_host, args.host_cores or host_cores(), memory, calibration=cal,
                             disk_bytes=disk, attention=kernel)
