"""Every setting as a documented dataclass field, parsed from Megatron-LM-named flags.

- :mod:`megazero.config.sections`: the dataclasses (one per concern), :class:`MegazeroConfig`
  and :class:`Derived`;
- :mod:`megazero.config.parsing`: flags, ``--config`` files and ``--model`` presets to a config;
- :mod:`megazero.config.megatron`: Megatron-LM's flags (aliases, speed/logging flags accepted and
  named in ``cfg.notes``, math-changing ones refused), applied by :func:`parse_args`;
- :mod:`megazero.config.validation`: :func:`validate` checks a config and returns it resolved
  (derived values filled in) without changing its argument; errors are :class:`ConfigError`
  (defined in :mod:`megazero.errors`, which the data and planning code import too) whose message
  names the flag and the fix.
"""
from megazero.config.parsing import build_parser, config_from_dict, parse_args
from megazero.config.sections import (SECTIONS, CheckpointConfig, DataConfig, Derived, LoggingConfig,
                                      MegazeroConfig, MoEConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                                      PrecisionConfig, ResilienceConfig, TrainingConfig, field_index, flag_of)
from megazero.config.validation import derive, validate
from megazero.config.one_process import one_process_model
from megazero.errors import ConfigError

__all__ = ["SECTIONS", "CheckpointConfig", "ConfigError", "DataConfig", "Derived", "LoggingConfig",
           "MegazeroConfig", "MoEConfig",
           "ModelConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig",
           "ResilienceConfig", "TrainingConfig", "build_parser", "config_from_dict", "derive", "field_index",
           "flag_of", "one_process_model", "parse_args", "validate"]
