"""ds_config keys as real configs carry them (issues 41 item 5b and 42): every key at DeepSpeed's default,
and every deprecated spelling DeepSpeed still takes, is accepted (silently where it changes nothing, named
with its meaning where it has one); a value megazero does not implement is refused naming the value that
is supported; numbers are finite and in range; a JSON file may not repeat a key."""
import json
import math

import pytest

from megazero.engine import ds_defaults
from megazero.engine.config import read_config
from megazero.errors import ConfigError

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _read(extra=None, dp=2, **kw):
    return read_config({**BASE, **(extra or {})}, dp, **kw)


def _refused(extra, needle):
    with pytest.raises(ConfigError) as err:
        _read(extra)
    message = str(err.value)
    assert needle in message and "\n" not in message, message
    return message


def cifar10_config(stage):
    """DeepSpeedExamples' training/cifar/ds_config.json, as its README ships it (one ZeRO stage)."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_examples_cifar10_config_is_read(tmp_path, stage):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cifar10_config(stage), indent=2))
    c = read_config(str(path), 2)
    m = c.megazero
    assert (c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps) == (16, 8, 1)
    assert m.parallel.zero_stage == stage and m.parallel.offload_optimizer_device == "none"
    assert m.optimizer.clip_grad == 1.0 and c.steps_per_print == 2000
    assert c.optimizer == ("adam", {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7})
    assert c.scheduler[0] == "WarmupLR" and not (m.precision.fp16 or m.precision.bf16)
    assert m.parallel.ddp_bucket_size == 50_000_000 and m.parallel.overlap_grad_reduce
    assert c.notes == []  # every key at DeepSpeed's default: nothing to say


# DeepSpeed 0.19.8's defaults (runtime/constants.py, runtime/zero/config.py, the section configs), written
# out as a config that spells every one of them
DEEPSPEED_DEFAULTS = {
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "gradient_allreduce_op": "mean",
    "communication_data_type": None, "seq_parallel_communication_data_type": "fp32",
    "sparse_gradients": False, "memory_breakdown": False, "dump_state": False, "disable_allgather": False,
    "disable_python_gc": False, "zero_allow_untested_optimizer": False, "zero_force_ds_cpu_optimizer": True,
    "wall_clock_breakdown": False, "dataloader_drop_last": False, "steps_per_print": None,
    "use_data_before_expert_parallelism": False, "managed_gradient_accumulation": True,
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "comet": {"enabled": False, "samples_log_interval": 100},
    "flops_profiler": {"enabled": False, "recompute_fwd_factor": 0.0, "profile_step": 1, "module_depth": -1,
                       "top_modules": 1, "detailed": True, "output_file": None},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False, "prof_ops": []},
    "amp": {"enabled": False}, "elasticity": {"enabled": False}, "torch_autocast": {"enabled": False},
    "autotuning": {"enabled": False}, "hybrid_engine": {"enabled": False},
    "data_efficiency": {"enabled": False},
    "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None,
                                 "contiguous_memory_optimization": False,
                                 "synchronize_checkpoint_boundary": False, "profile": False,
                                 "cpu_checkpointing": False},
    "checkpoint": {"tag_validation": "WARN", "load_universal": False, "use_node_local_storage": False,
                   "parallel_write": {"pipeline_stage": False}},
    "data_types": {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None,
                   "keep_in_fp32_modules": "auto"},
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
    "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
             "fp16_master_weights_and_grads": False},
    "bf16": {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
             "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
            "overlap_events": True, "use_gds": False},
    "zero_optimization": {
        "stage": 0, "contiguous_gradients": True, "reduce_scatter": True, "reduce_bucket_size": 5e8,
        "use_multi_rank_bucket_allreduce": True, "allgather_partitions": True, "allgather_bucket_size": 5e8,
        "overlap_comm": None, "compute_grad_norm": True, "load_from_fp32_weights": True,
        "elastic_checkpoint": False, "offload_param": None, "offload_optimizer": None, "zenflow": None,
        "sub_group_size": 1e9, "cpu_offload_param": None, "cpu_offload_use_pin_memory": None,
        "cpu_offload": None, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_model_persistence_threshold": 9223372036854775807, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": False,
        "stage3_module_granularity_threshold": 0, "stage3_use_all_reduce_for_fetch_params": False,
        "stage3_allgather_sequential": False, "stage3_gather_fp16_weights_on_model_save": False,
        "ignore_unused_parameters": True, "legacy_stage1": False, "round_robin_gradients": False,
        "parameter_alignment": False, "zero_hpz_partition_size": 1, "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False, "zero_quantized_gradients": False,
        "memory_efficient_linear": True, "pipeline_loading_checkpoint": False, "override_module_apply": True,
        "log_trace_cache_warnings": False, "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False},
}


OFFLOAD_DEFAULTS = {
    "offload_optimizer": {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True,
                          "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0,
                          "super_offload": False, "cpuadam_cores_perc": 0.8},
    "offload_param": {"device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 1e8,
                      "max_in_cpu": 1e9, "pin_memory": True}}
ADAM_DEFAULTS = {"type": "Adam", "legacy_fusion": False,
                 "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0,
                            "bias_correction": True, "amsgrad": False, "adam_w_mode": True,
                            "torch_adam": False}}


@pytest.mark.parametrize("spelled", [False, True])
def test_every_key_at_deepspeeds_default_is_accepted(spelled):
    config = {**BASE, **DEEPSPEED_DEFAULTS}
    if spelled:  # the sections DeepSpeed leaves null, written out at their defaults too
        config["zero_optimization"] = {**config["zero_optimization"], **OFFLOAD_DEFAULTS}
        config["optimizer"] = ADAM_DEFAULTS
    c = read_config(config, 2)
    assert c.megazero.parallel.zero_stage == 0 and not c.megazero.parallel.overlap_grad_reduce
    assert c.steps_per_print is None  # DeepSpeed 0.19.8: no progress lines
    assert c.notes == []


@pytest.mark.parametrize("table, where", [
    (ds_defaults.TOP, []), (ds_defaults.ZERO, ["zero_optimization"]),
    (ds_defaults.CHECKPOINT, ["checkpoint"]), (ds_defaults.DATA_TYPES, ["data_types"]),
    (ds_defaults.ACTIVATION_CHECKPOINTING, ["activation_checkpointing"]),
    (ds_defaults.BF16, ["bf16"]), (ds_defaults.OFFLOAD_OPTIMIZER, ["zero_optimization", "offload_optimizer"]),
])
def test_each_table_key_is_silent_at_its_default_and_refused_or_named_otherwise(table, where):
    def config(k, v):
        inner = {k: v}
        for name in reversed(where):
            inner = {name: inner}
        if where[:1] == ["zero_optimization"]:
            inner["zero_optimization"]["stage"] = 2
        return inner

    for k, (kind, default, what) in table.items():
        at_default = default[0] if kind == ds_defaults.FIXED else default
        assert k not in "\n".join(_read(config(k, at_default)).notes)
        other = "something else" if isinstance(at_default, (str, type(None))) else \
            (not at_default if isinstance(at_default, bool) else 7)
        if kind == ds_defaults.FIXED:
            message = _refused(config(k, other), f"{k} = ")
            assert f"({what}); remove it or give {ds_defaults.json_value(at_default)}" in message
        else:
            notes = "\n".join(_read(config(k, other)).notes)
            assert f"{k} = " in notes and what in notes


@pytest.mark.parametrize("extra, needle", [
    ({"gradient_allreduce_op": "sum"},
     'gradient_allreduce_op = "sum" is not supported (gradients are averaged over the data-parallel ranks); '
     'remove it or give "mean"'),
    ({"communication_data_type": "bf16"}, 'remove it or give null or "fp32" or "float32"'),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
     "zero_optimization.zero_quantized_gradients = true is not supported (ZeRO++ quantized gradients are "
     "not implemented); remove it or give false"),
    ({"amp": {"enabled": True}}, "amp.enabled = true is not supported (Apex AMP is not implemented"),
    ({"elasticity": {"enabled": True}}, "elasticity.enabled = true is not supported"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    ({"checkpoint": {"use_node_local_storage": True}}, "remove it or give false"),
    ({"checkpoint": {"tag_validaton": "Warn"}}, "unknown key 'checkpoint.tag_validaton'"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     "cpu_offload is DeepSpeed's deprecated spelling of zero_optimization.offload_optimizer.device cpu"),
    ({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}},
     "are one setting; give one"),
])
def test_a_value_megazero_does_not_implement_is_refused_naming_the_supported_one(extra, needle):
    _refused(extra, needle)


def test_values_with_a_meaning_are_accepted_and_named():
    c = _read({"prescale_gradients": True, "tensorboard": {"enabled": True, "output_path": "tb"},
               "zero_optimization": {"stage": 2, "cpu_offload": True, "prefetch_bucket_size": 123,
                                     "round_robin_gradients": True},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    notes = "\n".join(c.notes)
    assert c.megazero.parallel.offload_optimizer_device == "cpu" and c.prefetch_numel == 123
    for needle in ("prescale_gradients = true: accepted", "tensorboard.enabled = true: accepted",
                   "cpu_offload = true: accepted, DeepSpeed's deprecated spelling", "round_robin_gradients",
                   "max_grad_norm: ignored"):
        assert needle in notes, notes


@pytest.mark.parametrize("extra, needle", [
    ({"gradient_clipping": math.nan}, "gradient_clipping must be a finite number >= 0, got nan"),
    ({"gradient_clipping": math.inf}, "gradient_clipping must be a finite number >= 0, got inf"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [1.5, 0.999]}}},
     "optimizer.params.betas[0] must be a finite number >= 0 and < 1, got 1.5"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 2]}}}, "optimizer.params.betas[1] must be"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [math.nan, 0.9]}}}, "betas[0] must be a finite"),
    ({"optimizer": {"type": "Adam", "params": {"eps": 0}}},
     "optimizer.params.eps must be a finite number > 0"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.nan}}}, "optimizer.params.lr must be a finite"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": math.inf}}}, "params.weight_decay must be"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": math.nan}}}, "params.momentum must be"),
    ({"fp16": {"enabled": True, "loss_scale": math.nan}}, "fp16.loss_scale must be a finite number >= 0"),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}}, "fp16.initial_scale_power must be an integer"),
    ({"fp16": {"enabled": True, "min_loss_scale": math.inf}}, "fp16.min_loss_scale must be a finite"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.nan}}},
     "scheduler.params.warmup_max_lr must be a finite number >= 0"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": 2}}},
     "scheduler.params.cos_min_ratio must be a finite number >= 0 and <= 1"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}}, "warmup_num_steps must be"),
    ({"gradient_predivide_factor": math.nan}, "gradient_predivide_factor must be a finite number > 0"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
     "offload_optimizer.ratio must be a finite number >= 0 and <= 1"),
])
def test_numbers_are_finite_and_in_range(extra, needle):
    _refused(extra, needle)


def test_a_repeated_key_in_a_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "gradient_clipping": 0}')
    with pytest.raises(ConfigError, match=r"the key 'gradient_clipping' appears twice in one object "
                                          r"\(DeepSpeed refuses duplicate keys\); keep one$"):
        read_config(str(path), 1)
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", '
                    '"params": {"lr": 1e-3, "lr": 1.0}}}')
    with pytest.raises(ConfigError, match="the key 'lr' appears twice"):
        read_config(str(path), 1)
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", '
                    '"params": {"lr": 1}}, "scheduler": {"type": "WarmupLR", "params": {"lr": 1}}}')
    # the same name in two objects is no repetition
    with pytest.raises(ConfigError, match="unknown key 'scheduler.params.lr'"):
        read_config(str(path), 1)
