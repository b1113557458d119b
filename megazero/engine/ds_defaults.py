"""The ds_config keys megazero reads only to accept them: DeepSpeed's implementation choices, monitors,
deprecated spellings and switched-off features (names and defaults from DeepSpeed 0.19.8's
``runtime/constants.py``, ``runtime/zero/config.py`` and the section configs).

The rule (docs/engine.md): a key at DeepSpeed's default is accepted silently; a key whose value changes
nothing megazero computes (``INERT``) is accepted at any value, its meaning named in the engine's notes;
a key megazero implements at one value only (``FIXED``) is refused at any other, one line naming the
value that is supported.  A section switched by ``enabled`` is accepted whole while it is off."""
from __future__ import annotations

import sys
from typing import Any, Dict, Tuple

from megazero.errors import ConfigError

INERT, FIXED = "inert", "fixed"
_REDUCE = "megazero averages the gradients over the data-parallel ranks in its own reduction; where the " \
          "division happens changes no value beyond rounding"
_NO_DS_CHECKPOINTING = ("megazero.deepspeed has no checkpointing module: recompute with "
                        "torch.utils.checkpoint (DeepSpeed's activation checkpointing gives the same values)")
_MASTER = "master weights and optimizer states are fp32"

# key -> (kind, DeepSpeed's default (FIXED: the values supported), what megazero does)
TOP: Dict[str, Tuple[str, Any, str]] = {
    "prescale_gradients": (INERT, False, _REDUCE),
    "gradient_predivide_factor": (INERT, 1.0, _REDUCE),
    "gradient_allreduce_op": (FIXED, ("mean",), "gradients are averaged over the data-parallel ranks"),
    "communication_data_type": (FIXED, (None, "fp32", "float32"), "gradients are reduced in fp32"),
    "seq_parallel_communication_data_type": (INERT, "fp32", "the engine has no sequence parallelism"),
    "sparse_gradients": (INERT, False, "gradients are reduced dense (the same sums)"),
    "memory_breakdown": (INERT, False, "no memory lines are printed (engine.memory_bytes() gives the bytes)"),
    "dump_state": (INERT, False, "the engine prints no state dump"),
    "disable_allgather": (INERT, False, "updated partitions are all-gathered per bucket (the same values)"),
    "disable_python_gc": (INERT, False, "Python's garbage collector is left as it is"),
    "zero_allow_untested_optimizer": (INERT, False, "the engine's optimizers are its own (Adam, AdamW, SGD)"),
    "zero_force_ds_cpu_optimizer": (INERT, True, "the engine's optimizers are its own (Adam, AdamW, SGD)"),
    "vocabulary_size": (INERT, None, "only DeepSpeed's tensor-core alignment warning reads it"),
    "log_level": (INERT, None, "the engine prints its own lines"),
    "use_data_before_expert_parallelism": (INERT, False, "the engine has no expert parallelism"),
    "managed_gradient_accumulation": (FIXED, (True,), "the engine accumulates gradients over "
                                                      "gradient_accumulation_steps micro-batches itself"),
}

# sections switched by "enabled" (default false): what megazero does when one is on (INERT: accepted and
# named; FIXED: refused)
SWITCHED: Dict[str, Tuple[str, str]] = {
    "tensorboard": (INERT, "the engine writes no TensorBoard events"),
    "wandb": (INERT, "the engine logs nothing to wandb"),
    "csv_monitor": (INERT, "the engine writes no CSV monitor files"),
    "comet": (INERT, "the engine logs nothing to Comet"),
    "flops_profiler": (INERT, "the engine has no FLOPs profiler"),
    "comms_logger": (INERT, "the engine logs no collectives"),
    "autotuning": (INERT, "megazero does not autotune (set the batch and bucket keys)"),
    "amp": (FIXED, "Apex AMP is not implemented; use the bf16 or fp16 section"),
    "elasticity": (FIXED, "elastic batch sizes are not implemented; set the batch keys"),
    "torch_autocast": (FIXED, "autocast is not implemented; the bf16 and fp16 sections set the precision"),
    "hybrid_engine": (FIXED, "DeepSpeed's hybrid (generation) engine is not implemented"),
    "data_efficiency": (FIXED, "curriculum learning and data routing are not implemented"),
}

ACTIVATION_CHECKPOINTING = {k: (INERT, v, _NO_DS_CHECKPOINTING) for k, v in (
    ("partition_activations", False), ("number_checkpoints", None), ("contiguous_memory_optimization", False),
    ("synchronize_checkpoint_boundary", False), ("profile", False), ("cpu_checkpointing", False))}

CHECKPOINT = {
    "tag_validation": (INERT, "Warn", "every rank saves under the tag save_checkpoint is given"),
    # read by megazero.engine.ds_universal: the tag of load_checkpoint(dir) comes from latest_universal
    "load_universal": (INERT, False, "load_checkpoint(dir) reads the tag from dir/latest_universal; a "
                                     "universal checkpoint is recognised by its zero/ directory either way"),
    "use_node_local_storage": (FIXED, (False,), "every rank writes to the directory save_checkpoint names"),
    "parallel_write": (INERT, {"pipeline_stage": False}, "the engine has no pipeline stages"),
    "checkpoint_serialization": (INERT, True, "megazero writes its own checkpoint format"),
    "writer": (INERT, None, "megazero writes its own checkpoint format"),
    # megazero's own key (DeepSpeed ignores it): the layout save_checkpoint writes (megazero.engine.ds_save)
    "format": (FIXED, ("megazero", "deepspeed"), "the layout engine.save_checkpoint writes: megazero's own "
                                                 "or DeepSpeed's, docs/migration.md"),
    # read by megazero.engine.ds_save (true or false; training is the same either way)
    "slice_mappings": (INERT, False, "with format deepspeed, the checkpoint also holds DeepSpeed's "
                                     "param_slice_mappings for its ds_to_universal.py"),
}

DATA_TYPES = {
    "grad_accum_dtype": (FIXED, (None, "fp32", "float32"), "gradients are accumulated in fp32"),
    "param_dtype": (FIXED, (None,), "the bf16 and fp16 sections set the parameters' dtype"),
    "buffer_dtype": (FIXED, (None,), "buffers keep their dtype"),
    "keep_in_fp32_modules": (FIXED, ("auto",), "buffers keep their dtype"),
}

_ZERO_IMPL = "an implementation choice of DeepSpeed's; the same values"
ZERO = {
    "cpu_offload_use_pin_memory": (INERT, None, "megazero pins its host buffers whenever the model is on a "
                                                "GPU"),
    "round_robin_gradients": (INERT, False, _ZERO_IMPL),
    "use_multi_rank_bucket_allreduce": (INERT, True, _ZERO_IMPL),
    "parameter_alignment": (INERT, False, _ZERO_IMPL),
    "memory_efficient_linear": (INERT, True, _ZERO_IMPL),
    "override_module_apply": (INERT, True, _ZERO_IMPL),
    "pipeline_loading_checkpoint": (INERT, False, "the engine has no pipeline stages"),
    "log_trace_cache_warnings": (INERT, False, "the engine keeps no trace cache"),
    "enable_sanity_checks": (INERT, False, "the engine runs no extra ZeRO-3 checks"),
    "save_muon_momentum_buffer_in_memory": (INERT, False, "the engine has no Muon optimizer"),
    "compute_grad_norm": (INERT, True, "megazero always computes the global gradient norm"),
    "elastic_checkpoint": (INERT, False, "megazero reshards every checkpoint on load"),
    "ignore_unused_parameters": (INERT, True, "a parameter without a gradient gets a zero gradient"),
    "zero_hpz_partition_size": (INERT, 1, "ZeRO++'s secondary partition changes memory and traffic only; "
                                          "megazero keeps one partition"),
    "stage3_model_persistence_threshold": (INERT, sys.maxsize, "megazero keeps no parameter whole between "
                                                               "uses"),
    "stage3_module_granularity_threshold": (INERT, 0, "ZeRO-3 units are the submodules owning parameters"),
    "stage3_use_all_reduce_for_fetch_params": (INERT, False, _ZERO_IMPL),
    "stage3_allgather_sequential": (INERT, False, _ZERO_IMPL),
    "leaf_module": (INERT, None, "ZeRO-3 units are the submodules owning parameters (the same values)"),
    "load_from_fp32_weights": (FIXED, (True,), "the fp32 master weights are loaded from the checkpoint's "
                                               "fp32 copies"),
    "legacy_stage1": (FIXED, (False,), "DeepSpeed's legacy stage 1 is not implemented"),
    "zero_quantized_weights": (FIXED, (False,), "ZeRO++ quantized weights are not implemented"),
    "zero_quantized_nontrainable_weights": (FIXED, (False,), "ZeRO++ quantized weights are not implemented"),
    "zero_quantized_gradients": (FIXED, (False,), "ZeRO++ quantized gradients are not implemented"),
    "zenflow": (FIXED, (None,), "ZenFlow is not implemented"),
}
# DeepSpeed's ZeRO config takes these field names as well as their stage3_ aliases
ZERO_ALIASES = {name: "stage3_" + name for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")}

OFFLOAD_OPTIMIZER = {
    "pipeline_read": (INERT, False, "the NVMe reads are overlapped by megazero's streaming buffers"),
    "pipeline_write": (INERT, False, "the NVMe writes are overlapped by megazero's streaming buffers"),
    "super_offload": (FIXED, (False,), "SuperOffload is not implemented"),
    "cpuadam_cores_perc": (INERT, 0.8, "megazero's CPU optimizer uses torch's threads"),
}

BF16 = {
    "bf16_master_weights_and_grads": (FIXED, (False,), _MASTER),
    "bf16_optimizer_states": (FIXED, (False,), _MASTER),
}


def json_value(v) -> str:
    """``v`` as JSON spells it (true, false, null; strings quoted)."""
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    return f'"{v}"' if isinstance(v, str) else repr(v)


def same_value(value, default) -> bool:
    """Whether ``value`` is ``default`` as DeepSpeed reads it (1 is 1.0; booleans are not numbers; case
    is ignored in words)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, str) and isinstance(default, str):
        return value.lower() == default.lower()
    return value == default


def read_table(r, table: Dict[str, Tuple[str, Any, str]]) -> None:
    """Every key of ``table`` present in reader ``r``: silent at DeepSpeed's default, named in the notes
    (INERT) or refused naming the supported value (FIXED) otherwise."""
    for k, (kind, default, what) in table.items():
        if k not in r:
            continue
        value = r.get(k)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            r.number(k, None)  # a number, and finite
        if kind == FIXED:
            if not any(same_value(value, ok) for ok in default):
                supported = " or ".join(json_value(v) for v in default)
                raise ConfigError(f"ds_config {r.key(k)} = {json_value(value)} is not supported ({what}); "
                                  f"remove it or give {supported}")
        elif not same_value(value, default):
            r.notes.append(f"ds_config {r.key(k)} = {json_value(value)}: accepted, {what}")


def read_switched(r, k: str) -> None:
    """A section switched by ``enabled`` (``SWITCHED``): accepted whole while off."""
    section = r.section(k)
    on = section.boolean("enabled", False)
    kind, what = SWITCHED[k]
    if on and kind == FIXED:
        raise ConfigError(f"ds_config {section.key('enabled')} = true is not supported ({what}); remove the "
                          f"section or give false")
    if on:
        r.notes.append(f"ds_config {k}.enabled = true: accepted, {what}")
