"""What ``plan.py`` says: each layout's description, ``pretrain_gpt.py`` flags and JSON, the base
config from the model flags, and the smallest change when nothing fits (:func:`advice`).

On a CPU host (``Hardware.device == "cpu"``) memory is the host's, shared by its ranks, so the
figures quoted are the host's (its ranks together) and "more GPUs" becomes more hosts of the same
size; the optimizer's first offload step is the disk, since host memory is the same memory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence

from megazero.config import ConfigError, parse_args, validate
from megazero.offload.settings import optimizer_device, param_device
from megazero.planning.estimate import estimate_rank
from megazero.planning.hardware import GB, Hardware
from megazero.planning.planner import Layout, layout_config, plan, smallest_memory

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--zero-stage",
                "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size", "--sequence-parallel",
                "--recompute-granularity", "--use-distributed-optimizer", "--pipeline-schedule",
                "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
# the offload tiers: taken from the model flags, emitted again per layout by flags() (with a value / without)
OFFLOAD_FLAGS = ("--offload-optimizer-device", "--offload-param-device", "--nvme-path")
OFFLOAD_SWITCHES = ("--offload-optimizer",)


def _needs(x: Layout, hw: Hardware) -> str:
    """What a layout needs of the memory the budget holds: a GPU's, or a CPU host's."""
    if hw.device != "cpu":
        return f"{x.memory_bytes / GB:.1f} GB per GPU"
    ranks = f"{hw.gpus_per_node} ranks sharing it" if hw.gpus_per_node > 1 else "one rank"
    return f"{x.host_bytes / GB:.1f} GB of the host's {hw.memory_bytes / GB:.0f} GB ({ranks})"


def _disk(nvme, x: Layout, hw: Hardware, gpus: int, saved, states) -> str:
    if hw.device == "cpu":
        free = "" if hw.disk_bytes is None else f" ({hw.disk_bytes / GB:.0f} GB free)"
        return f"{x.disk_bytes / GB:.1f} GB of the host's disk{free}"
    disk = estimate_rank(layout_config(nvme, x, gpus), 0, saved=saved, states=states)["nvme_bytes"]
    return f"{disk / GB:.1f} GB of disk per rank"


def _offloaded(cfg, **tiers):
    par = cfg.parallel
    return validate(cfg.replace(parallel=dict(tiers, nvme_path=par.nvme_path or "NVME_DIR")),
                    par.world_size, check_data=False)


def advice(cfg, gpus: int, hw: Hardware, margin: float, choices: Dict[str, object], *, saved) -> str:
    """The smallest change that makes something fit: lift the given restrictions (micro-batch
    sizes, recomputation, ZeRO stages), offload the optimizer (to host memory from a GPU, to the
    disk from a CPU host), both tiers to NVMe, more GPUs (hosts), or more memory."""
    cpu, par = hw.device == "cpu", cfg.parallel
    states: dict = {}  # model states, shared by the searches below (keyed by the whole config)
    if any(v is not None for v in choices.values()):
        found = plan(cfg, gpus, hw, margin, saved=saved, states=states)
        if found:
            return (f"allow every micro-batch size, recomputation and ZeRO stage: e.g. {describe(found[0])} "
                    f"needs {_needs(found[0], hw)}")
    if cpu and hw.disk_bytes is not None and "nvme" in (optimizer_device(par), param_device(par)):
        found = plan(cfg, gpus, replace(hw, disk_bytes=None), margin, saved=saved, states=states)
        if found:
            return (f"a disk with more room: {describe(found[0])} needs {found[0].disk_bytes / GB:.1f} GB of "
                    f"swap files on the host's disk, which has {hw.disk_bytes / GB:.0f} GB free (--nvme-path "
                    f"elsewhere, or --host-disk-gb)")
    offloaded = ""
    if not cpu and optimizer_device(par) == "none":
        offloaded = " (--offload-optimizer alone is not enough)"
        off = validate(cfg.replace(parallel={"offload_optimizer": True, "zero_stage": 3}), par.world_size,
                       check_data=False)
        found = plan(off, gpus, hw, margin, saved=saved, states=states)
        if found:
            return (f"add --offload-optimizer (optimizer state in host memory): {describe(found[0])} needs "
                    f"{_needs(found[0], hw)}")
    if cpu and optimizer_device(par) == "none":
        off = _offloaded(cfg, offload_optimizer_device="nvme", zero_stage=3)
        found = plan(off, gpus, hw, margin, saved=saved, states=states)
        if found:
            return (f"add --offload-optimizer-device nvme --nvme-path DIR (optimizer state on a local disk): "
                    f"{describe(found[0])} needs {_needs(found[0], hw)} and "
                    f"{_disk(off, found[0], hw, gpus, saved, states)}; {_predicted(found[0], hw)}")
    if param_device(par) != "nvme":
        nvme = _offloaded(cfg, offload_optimizer=False, offload_optimizer_device="nvme",
                          offload_param_device="nvme", zero_stage=3)
        found = plan(nvme, gpus, hw, margin, saved=saved, states=states)
        if found:
            return (f"only with ZeRO-Infinity offload: add --offload-optimizer-device nvme "
                    f"--offload-param-device nvme --nvme-path DIR (model state on a local disk): "
                    f"{describe(found[0])} needs {_needs(found[0], hw)} and "
                    f"{_disk(nvme, found[0], hw, gpus, saved, states)}; {_predicted(found[0], hw)}")
        offloaded = " (offloading the optimizer and the parameters to NVMe is not enough"
        short_of_disk = cpu and hw.disk_bytes is not None and plan(
            nvme, gpus, replace(hw, disk_bytes=None), margin, saved=saved, states=states)
        if short_of_disk:
            offloaded += f": its swap files need more than the {hw.disk_bytes / GB:.0f} GB free on the disk"
        offloaded += ")"
    return _more(cfg, gpus, hw, margin, saved, states, offloaded)


def _predicted(x: Layout, hw: Hardware) -> str:
    return (f"predicted {x.step['step_time_s']:.3g} s per step, {x.step['nvme_s']:.3g} s of it waiting on a "
            f"disk of {hw.disk_bytes_per_s / GB:.1f} GB/s per {'host' if hw.device == 'cpu' else 'node'}")


def _more(cfg, gpus: int, hw: Hardware, margin: float, saved, states, offloaded: str) -> str:
    """More GPUs (hosts like this one), or more memory per GPU (host)."""
    cpu = hw.device == "cpu"
    for factor in (2, 4, 8, 16):
        more = gpus * factor
        found = plan(cfg, more, hw, margin, saved=saved, states=states)
        if found:
            where = (f"{more} ranks on {-(-more // hw.gpus_per_node)} hosts like this one" if cpu
                     else f"{more} GPUs")
            return f"use {where} (x{factor}): {describe(found[0])} needs {_needs(found[0], hw)}{offloaded}"
    least = smallest_memory(cfg, gpus, hw, saved=saved, states=states)
    if least is None:
        return "no layout divides this model and batch on these GPUs; change --gpus or --global-batch-size"
    need = least.host_bytes if cpu else least.memory_bytes
    budget = (1.0 - margin) * hw.memory_bytes
    unit = "host" if cpu else "GPU"
    return (f"{unit}s with at least {need / (1 - margin) / GB:.0f} GB, or more than {gpus * 16} "
            f"{'ranks' if cpu else 'GPUs'}{offloaded}: {describe(least)}, the leanest layout here, needs "
            f"{need / GB:.1f} GB per {unit} against a budget of {budget / GB:.1f} GB")


def describe(x: Layout) -> str:
    rc = "" if x.recompute == "none" else f" recompute {x.recompute}"
    cp = f" x CP {x.cp}" if x.cp > 1 else ""
    split = f" (vpp {x.vpp})" if x.vpp > 1 else ""
    if x.first is not None:
        split = f" (first {x.first}, last {x.last} layers)"
    return (f"TP {x.tp}{' SP' if x.sequence_parallel else ''}{cp} x PP {x.pp}{split} x DP {x.dp}, "
            f"ZeRO-{x.zero_stage}{rc}, micro-batch {x.micro_batch_size}")


def _without_offload(model_args: Sequence[str]) -> List[str]:
    """The model flags without the offload tiers' (which :func:`flags` gives per layout)."""
    out, skip = [], False
    for a in model_args:
        name = a.split("=")[0]
        if skip:
            skip = False
        elif name in OFFLOAD_FLAGS:
            skip = "=" not in a
        elif name not in OFFLOAD_SWITCHES:
            out.append(a)
    return out


def flags(layout: Layout, model_args: Sequence[str], cfg) -> List[str]:
    """The exact ``pretrain_gpt.py`` flags of a layout (model flags as given, then the layout's)."""
    out = _without_offload(model_args) + [
        "--seq-length", str(cfg.model.seq_length), "--global-batch-size", str(cfg.training.global_batch_size),
        "--micro-batch-size", str(layout.micro_batch_size), "--tensor-model-parallel-size", str(layout.tp),
        "--pipeline-model-parallel-size", str(layout.pp)]
    if layout.cp > 1:
        out += ["--context-parallel-size", str(layout.cp)]
    if layout.vpp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage",
                str(cfg.model.num_layers // (layout.pp * layout.vpp))]
    if layout.first is not None:
        out += ["--decoder-first-pipeline-num-layers", str(layout.first),
                "--decoder-last-pipeline-num-layers", str(layout.last)]
    if layout.sequence_parallel:
        out.append("--sequence-parallel")
    if layout.zero_stage:
        out += ["--zero-stage", str(layout.zero_stage)]
    if layout.recompute != "none":
        out += ["--recompute-granularity", layout.recompute]
    par = cfg.parallel
    if layout.zero_stage and optimizer_device(par) != "none":
        out += (["--offload-optimizer"] if optimizer_device(par) == "cpu" and not par.offload_optimizer_device
                else ["--offload-optimizer-device", optimizer_device(par)])
    if layout.zero_stage == 3 and param_device(par) != "none":
        out += ["--offload-param-device", param_device(par)]
    if "nvme" in (optimizer_device(par), param_device(par)) and layout.zero_stage:
        out += ["--nvme-path", par.nvme_path]
    if cfg.precision.bf16:
        out.append("--bf16")
    elif cfg.precision.fp16:
        out.append("--fp16")
    return out


def to_dict(layout: Layout, model_args: Sequence[str], cfg) -> Dict[str, object]:
    """The JSON form of one planned layout (on CPU hosts with the host's memory and disk)."""
    out = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "vpp": layout.vpp, "dp": layout.dp,
           "decoder_first_pipeline_num_layers": layout.first, "decoder_last_pipeline_num_layers": layout.last,
           "zero_stage": layout.zero_stage, "recompute": layout.recompute,
           "sequence_parallel": layout.sequence_parallel, "micro_batch_size": layout.micro_batch_size,
           "memory_gb": round(layout.memory_bytes / GB, 3), "step_time_s": layout.step["step_time_s"],
           "tokens_per_sec": layout.step["tokens_per_sec"], "mfu": layout.step["mfu"],
           "breakdown": {k: v for k, v in layout.step.items() if k.endswith("_s") and k != "step_time_s"},
           "flags": " ".join(flags(layout, model_args, cfg))}
    if layout.host_bytes:
        out.update(host_memory_gb=round(layout.host_bytes / GB, 3),
                   host_disk_gb=round(layout.disk_bytes / GB, 3))
    return out


def model_config(model_args: Sequence[str], presets, seq_length: Optional[int], global_batch_size: int,
                 fp32: bool):
    """The base config (model, batch, precision, offload tiers) the layouts share; ConfigError on
    bad flags.  Offload tiers are checked at ZeRO-3, which holds every tier; the planner keeps the
    stages that can hold them (:func:`megazero.planning.planner.min_zero_stage`)."""
    given = [a for a in model_args if a.split("=")[0] in LAYOUT_FLAGS]
    if given:
        raise ConfigError(f"{given[0].split('=')[0]}: the planner chooses the layout; drop the flag "
                          "(restrict with --micro-batch-sizes, --recompute, --zero-stages)")
    if global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be a positive integer, got {global_batch_size}")
    argv = list(model_args) + ["--global-batch-size", str(global_batch_size), "--micro-batch-size", "1"]
    if any(a.split("=")[0] in OFFLOAD_FLAGS + OFFLOAD_SWITCHES for a in model_args):
        argv += ["--zero-stage", "3"]
    if seq_length is not None:
        argv += ["--seq-length", str(seq_length)]
    if not fp32 and "--fp16" not in argv and "--bf16" not in argv:
        argv.append("--bf16")
    return parse_args(argv, presets=presets, world_size=1, check_data=False)
