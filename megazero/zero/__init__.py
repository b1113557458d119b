"""ZeRO on the data-parallel axis: flat buffers and buckets, stages 0-3, CPU offload, memory accounting."""
from megazero.zero.state_bytes import optimizer_bytes_per_param, zero_model_state_bytes
from megazero.zero.optimizer import ZeroOptimizer, build_optimizer

__all__ = ["ZeroOptimizer", "build_optimizer", "zero_model_state_bytes", "optimizer_bytes_per_param"]
