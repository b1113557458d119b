"""GPT-family models built from megazero's tensor-parallel layers.

- :func:`build_model` (``cfg, mesh=None``): the whole model (pp = 1).
- :func:`build_chunks` (``cfg, mesh``): this rank's pipeline chunks, one per virtual stage.
- :mod:`models.presets`: named architectures (``tiny``, ``gpt2-small`` ... ``llama3-8b``).
- :mod:`models.hf`: Hugging Face ``transformers`` import and export.
- :func:`generate` (``model, ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id``):
  greedy or sampled continuation with a KV cache (:mod:`models.generate`).
- :mod:`models.checkpoint`: ``load_model(directory)``, a whole model from a training checkpoint.
- :mod:`models.saved_activations`: what the model saves for backward, the memory estimator's
  ``saved`` argument (:mod:`megazero.planning.estimate`).
"""
from __future__ import annotations

from typing import List, Optional


from megazero.mesh import ParallelMesh
from megazero.pipeline.partition import chunk_layers
from megazero.tensor_parallel.rng import RNGTracker, seed_default_generators
from .generate import generate  # noqa: F401
from .gpt import GPTModel, full_state_dict, load_full_state_dict  # noqa: F401
from .presets import PRESETS, get_preset  # noqa: F401
from . import saved_activations  # noqa: F401


def build_chunks(cfg, mesh: Optional[ParallelMesh] = None) -> List[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), building only their layers.

    Seeds the default generator with ``seed + 100 * pp_rank`` (dropout outside TP-split regions)
    and creates one :class:`RNGTracker` shared by the chunks. ``cfg`` must be validated.
    """
    mesh = mesh or ParallelMesh.single()
    if mesh.size("pp") != cfg.parallel.pipeline_model_parallel_size:
        raise ValueError(f"mesh pp size {mesh.size('pp')} != --pipeline-model-parallel-size "
                         f"{cfg.parallel.pipeline_model_parallel_size}")
    stage_seed = seed_default_generators(cfg.training.seed, mesh)
    tracker = RNGTracker(stage_seed, mesh.coord("tp"), mesh.device)
    ranges = chunk_layers(cfg, mesh.coord("pp"))
    return [GPTModel(cfg, mesh, layers, pre_process=mesh.is_first_stage and v == 0,
                     post_process=mesh.is_last_stage and v == len(ranges) - 1, rng_tracker=tracker)
            for v, layers in enumerate(ranges)]


def build_model(cfg, mesh: Optional[ParallelMesh] = None) -> GPTModel:
    """The whole GPT model (one process or tensor parallel; pp must be 1).

    Called on token ids ``[b, s]`` without labels it returns logits ``[b, s, vocab]`` (unpadded).
    """
    if cfg.parallel.pipeline_model_parallel_size != 1:
        raise ValueError("build_model builds the whole model; with --pipeline-model-parallel-size > 1 "
                         "use build_chunks(cfg, mesh) for this rank's stage")
    return build_chunks(cfg, mesh)[0]
