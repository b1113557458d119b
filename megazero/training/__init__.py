"""The trainer and its parts.

- :mod:`.loop`: the training loop (:func:`train`) that composes the mesh, a model, the ZeRO optimizer
  and the pipeline executor; start-up, one step, evaluation;
- :mod:`.log`: console, metrics file, wandb and TensorBoard logging;
- :mod:`.summary`: the start-up summary (parameters, settings, data, tokenizer);
- :mod:`.saver`: periodic, final and background checkpoint saves;
- :mod:`.lr`: Megatron-LM's learning-rate schedule;
- :mod:`.profiling`: ``--profile``, a torch.profiler trace of chosen steps on chosen ranks.
"""
from megazero.training.loop import (ModelProvider, Position, build_mesh, evaluate, init_distributed,
                                    peak_rss_bytes, train)

__all__ = ["ModelProvider", "Position", "build_mesh", "evaluate", "init_distributed", "peak_rss_bytes",
           "train"]
