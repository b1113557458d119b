"""Once per training step, after backward: the routers' records reduced over the world (one
all-reduce), the expert biases moved, and the metrics row's MoE entries."""
from __future__ import annotations

from typing import Dict

from megazero.moe.router import TopKRouter, update_expert_bias
from megazero.moe.settings import moe_layers, mtp_moe_layers
from megazero.moe.stats import reduce_step, step_metrics


def finish_step(chunks, mesh, cfg, num_micro_batches: int) -> Dict[str, float]:
    """After the step's backward, ``num_micro_batches`` per data-parallel rank.  Collective (every rank
    calls it, MoE model or not: it returns ``{}`` at once without MoE layers).
    Returns ``moe_aux_loss``, ``moe_z_loss`` (per micro-batch, averaged over the MoE layers; each only
    when its coefficient is set),
    ``moe_tokens_per_expert_min``/``_max``, ``moe_imbalance`` and ``moe_dropped_tokens``
    (:func:`megazero.moe.stats.step_metrics`)."""
    layers = moe_layers(cfg) + mtp_moe_layers(cfg)  # the multi-token prediction layers last
    reduced = reduce_step(chunks, mesh, layers, cfg.moe.num_experts or 0, num_micro_batches,
                          cfg.parallel.data_parallel_size)
    if reduced is None:
        return {}
    row = {layer: i for i, layer in enumerate(layers)}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                update_expert_bias(module, reduced["tokens"][row[module.layer_idx]])
    out = step_metrics(reduced)
    moe = cfg.moe
    if moe.moe_router_load_balancing_type == "none" or not moe.moe_aux_loss_coeff:
        del out["moe_aux_loss"]  # not computed: no value to report
    if not moe.moe_z_loss_coeff:
        del out["moe_z_loss"]
    return out
