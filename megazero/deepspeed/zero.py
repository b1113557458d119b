"""``deepspeed.zero``: :class:`Init`, :class:`GatheredParameters`, :func:`register_external_parameter`
(:mod:`megazero.zero.partition`, :mod:`megazero.engine.units`)."""
from megazero.zero.partition import GatheredParameters, Init
from megazero.engine.units import register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
