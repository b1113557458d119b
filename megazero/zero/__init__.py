"""ZeRO on the data-parallel axis: flat buffers and buckets, stages 0-3, CPU offload, memory accounting,
and DeepSpeed's ``zero.Init`` / ``zero.GatheredParameters`` for the any-model engine
(:mod:`megazero.zero.partition`)."""
from megazero.zero.partition import GatheredParameters, Init
from megazero.zero.state_bytes import optimizer_bytes_per_param, zero_model_state_bytes
from megazero.zero.optimizer import ZeroOptimizer, build_optimizer

__all__ = ["GatheredParameters", "Init", "ZeroOptimizer", "build_optimizer", "zero_model_state_bytes",
           "optimizer_bytes_per_param"]
