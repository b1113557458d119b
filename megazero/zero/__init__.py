"""ZeRO on the data-parallel axis: flat buffers and buckets, stages 0-3, CPU offload, memory accounting.

``Init`` and ``GatheredParameters`` (DeepSpeed's ``zero.Init`` and ``zero.GatheredParameters``, for
the any-model engine) come from :mod:`megazero.engine.partition` on first use."""
from megazero.zero.state_bytes import optimizer_bytes_per_param, zero_model_state_bytes
from megazero.zero.optimizer import ZeroOptimizer, build_optimizer

__all__ = ["GatheredParameters", "Init", "ZeroOptimizer", "build_optimizer", "zero_model_state_bytes",
           "optimizer_bytes_per_param"]


def __getattr__(name):
    if name in ("Init", "GatheredParameters"):
        from megazero.engine import partition
        return getattr(partition, name)
    raise AttributeError(f"module 'megazero.zero' has no attribute {name!r}")
