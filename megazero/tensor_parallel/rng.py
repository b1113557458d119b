"""Model-parallel RNG: dropout that differs across TP ranks where activations are split.

Dropout on activations that every tensor-parallel rank holds in full (hidden dropout without
sequence parallelism) must draw the same mask on every TP rank, so it uses the device's
default generator, seeded identically there.  Dropout on activations split across TP ranks
(attention probabilities, split by head; anything under sequence parallelism) must draw a
different mask on each rank: it runs inside ``tracker.fork()``, which swaps in a generator
state seeded with ``seed + 2718 + tp_rank`` and saves it back afterwards.  The default generator
is seeded per pipeline stage by :func:`seed_default_generators`.

The tracker is an object passed to the model, never module state.  Activation recomputation
saves and restores its states (``get_state``/``set_state``) together with the default RNG.
"""
from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100


def seed_default_generators(seed: int, mesh) -> int:
    """Seed the default generators (CPU, and the mesh's GPU) with ``seed + 100 * pp_rank``: the same
    on every TP and DP rank of a pipeline stage.  Returns that stage seed."""
    stage_seed = seed + PP_SEED_STRIDE * mesh.coord("pp")
    torch.manual_seed(stage_seed)
    if mesh.device.type == "cuda":
        with torch.cuda.device(mesh.device):
            torch.cuda.manual_seed(stage_seed)
    return stage_seed


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Holds the generator state used for dropout inside tensor-parallel regions."""

    def __init__(self, seed: int, tp_rank: int = 0, device: torch.device = torch.device("cpu")):
        self.device = torch.device(device)
        saved = _get_rng_state(self.device)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # this mesh's device, not whichever is current
                torch.cuda.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        else:
            torch.default_generator.manual_seed(seed + TP_SEED_OFFSET + tp_rank)
        self._state = _get_rng_state(self.device)
        _set_rng_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self):
        """Run the body with the tensor-parallel generator state, then store its advanced state."""
        outer = _get_rng_state(self.device)
        _set_rng_state(self._state, self.device)
        try:
            yield
        finally:
            self._state = _get_rng_state(self.device)
            _set_rng_state(outer, self.device)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()
