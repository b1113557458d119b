"""``deepspeed.utils``: :mod:`~megazero.deepspeed.utils.zero_to_fp32`."""
from megazero.deepspeed.utils import zero_to_fp32

__all__ = ["zero_to_fp32"]
