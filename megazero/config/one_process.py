"""A run's model as one process holds it: the same model and MoE settings at TP = PP = EP = 1 with no
data, validated, for what writes or reads the whole model (converting a Megatron-LM checkpoint)."""
from __future__ import annotations

from dataclasses import fields

from megazero.config.parsing import config_from_dict
from megazero.config.sections import ModelConfig, MoEConfig
from megazero.config.validation import validate

PER_LAYOUT = {"expert_model_parallel_size", "expert_tensor_parallel_size"}


def one_process_model(cfg):
    """``cfg``'s model and MoE settings (derived values and layout sizes left out) at one process."""
    d, settings = cfg.to_dict(), {}
    for section, cls in (("model", ModelConfig), ("moe", MoEConfig)):
        keep = {f.name for f in fields(cls) if not f.metadata.get("derived")} - PER_LAYOUT
        settings.update({k: v for k, v in d.get(section, {}).items() if k in keep})
    return validate(config_from_dict(dict(settings, mock_data=True)), 1, check_data=False)
