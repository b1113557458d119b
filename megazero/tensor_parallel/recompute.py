"""Activation recomputation that replays dropout exactly.

:func:`recompute` runs ``function(*args)`` without keeping its activations and runs it again
during backward.  The default generator's state (CPU or the current CUDA device) and the
tensor-parallel :class:`~megazero.tensor_parallel.rng.RNGTracker` state are captured before
the first run and restored for the second, so dropout masks are identical and results equal a
run without recomputation.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from megazero.tensor_parallel.rng import RNGTracker, _get_rng_state, _set_rng_state


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, tracker, device, *args):
        ctx.function, ctx.tracker, ctx.device = function, tracker, device
        ctx.rng_state = _get_rng_state(device)
        ctx.tracker_state = tracker.get_state() if tracker is not None else None
        tensor_idx = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.tensor_idx = tensor_idx
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in tensor_idx])
        with torch.no_grad():
            out = function(*args)
        return out

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_idx, saved):
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            args[i] = d
        # replay with the RNG states of the first run, then put the current ones back
        now_rng = _get_rng_state(ctx.device)
        now_tracker = ctx.tracker.get_state() if ctx.tracker is not None else None
        _set_rng_state(ctx.rng_state, ctx.device)
        if ctx.tracker is not None:
            ctx.tracker.set_state(ctx.tracker_state)
        try:
            with torch.enable_grad():
                out = ctx.function(*args)
        finally:
            _set_rng_state(now_rng, ctx.device)
            if ctx.tracker is not None:
                ctx.tracker.set_state(now_tracker)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        inputs = [args[i].grad if torch.is_tensor(args[i]) and args[i].requires_grad else None
                  for i in range(len(args))]
        return (None, None, None, *inputs)


def recompute(function, *args: Any, tracker: Optional[RNGTracker] = None,
              device: Optional[torch.device] = None):
    """``function(*args)``, its activations recomputed in backward (dropout replayed exactly).

    Only tensor outputs flow gradients; ``function`` must not rely on tensors other than its
    arguments requiring gradients through closures, except module parameters (which receive
    their gradients during the replay).
    """
    if device is None:
        first = next((a for a in args if torch.is_tensor(a)), None)
        device = first.device if first is not None else torch.device("cpu")
    return _Recompute.apply(function, tracker, torch.device(device), *args)
