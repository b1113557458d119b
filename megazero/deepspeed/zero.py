"""``deepspeed.zero``: :class:`Init`, :class:`GatheredParameters`, :func:`register_external_parameter`
(:mod:`megazero.engine.partition`, :mod:`megazero.engine.units`)."""
from megazero.engine.partition import GatheredParameters, Init
from megazero.engine.units import register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
