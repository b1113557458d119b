"""``deepspeed.utils.zero_to_fp32`` (:mod:`megazero.engine.consolidate`; the script is
``scripts/zero_to_fp32.py``)."""
from megazero.engine.consolidate import (convert_zero_checkpoint_to_fp32_state_dict,
                                         get_fp32_state_dict_from_zero_checkpoint,
                                         load_state_dict_from_zero_checkpoint)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
