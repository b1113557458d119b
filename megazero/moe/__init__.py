"""Mixture of experts: expert parallelism on the mesh's expert decomposition (``etp x ep x edp x pp``).

The pieces, each testable alone (``tests/test_moe_pieces.py``):

- :mod:`~megazero.moe.settings`: the flags' rules and the MoE layer pattern (pure Python);
- :mod:`~megazero.moe.routing`: top-k routing, capacity, the auxiliary losses, as tensor functions;
- :mod:`~megazero.moe.router`: :class:`TopKRouter`, the router module (its weight, expert bias, losses);
- :mod:`~megazero.moe.experts`: :func:`grouped_product` and :class:`GroupedExperts`, a rank's experts;
- :mod:`~megazero.moe.comm` and :mod:`~megazero.moe.dispatcher`: the token dispatchers (all-to-all over
  EP, all-gather over expert TP x EP) as autograd collectives;
- :mod:`~megazero.moe.stats`: the auxiliary losses' backward scale and the per-step records
  (:class:`MoEStats`); :mod:`~megazero.moe.step`: :func:`finish_step`, once per step (one all-reduce,
  the expert-bias update, the metrics).

The MoE layer that composes them is ``megazero_models.moe.MoELayer``.
"""
from megazero.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher, build_dispatcher
from megazero.moe.experts import EXPERT_PARAMS, GroupedExperts, grouped_product
from megazero.moe.router import TopKRouter, update_expert_bias
from megazero.moe.settings import is_moe, moe_layer_pattern, moe_layers
from megazero.moe.stats import (MoEStats, attach_loss, chunk_stats, reduce_step, set_backward_scale,
                                step_metrics)
from megazero.moe.step import finish_step

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "EXPERT_PARAMS", "GroupedExperts", "MoEStats",
           "TopKRouter", "attach_loss", "build_dispatcher", "chunk_stats", "finish_step", "grouped_product",
           "is_moe",
           "moe_layer_pattern", "moe_layers", "reduce_step", "set_backward_scale", "step_metrics",
           "update_expert_bias"]
