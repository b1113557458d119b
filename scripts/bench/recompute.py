#!/usr/bin/env python
"""Activation memory kept for backward, per recomputation mode (measured, not asserted).

Builds the same model once per mode (none, selective, full uniform, full block) and counts the
bytes of the distinct tensors autograd saves during one forward (via saved-tensor hooks; the
parameters are excluded), then prints them beside the estimator's prediction
(megazero.planning.estimate.activation_bytes) and the ratio to no recomputation.

    python scripts/bench_recompute.py [--num-layers 4 --hidden-size 128 --seq-length 256 ...]
"""
import argparse


import torch

from megazero.config import config_from_dict, validate
from megazero.planning.estimate import activation_bytes
from megazero.process.threads import set_rank_threads
import megazero_models as models

MODES = {"none": {}, "selective": {"recompute_granularity": "selective"},
         "full uniform (1 layer/group)": {"recompute_granularity": "full", "recompute_method": "uniform",
                                          "recompute_num_layers": 1},
         "full block (half the layers)": {"recompute_granularity": "full", "recompute_method": "block"}}


def saved_bytes(cfg) -> int:
    """Bytes of distinct non-parameter tensors saved for backward in one forward pass."""
    torch.manual_seed(0)
    model = models.build_model(cfg)
    params = {p.data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.training.micro_batch_size, cfg.model.seq_length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return sum(seen.values())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    a = p.parse_args(argv)
    set_rank_threads()
    base = dict(mock_data=True, num_layers=a.num_layers, hidden_size=a.hidden_size,
                num_attention_heads=a.num_attention_heads, seq_length=a.seq_length,
                micro_batch_size=a.micro_batch_size, vocab_size=a.vocab_size, hidden_dropout=0.1,
                attention_dropout=0.1)
    print(f"{'mode':<30} {'measured MiB':>13} {'vs none':>8} {'estimate MiB':>13}")
    ref = None
    for name, extra in MODES.items():
        if extra.get("recompute_method") == "block":
            extra = dict(extra, recompute_num_layers=max(1, a.num_layers // 2))
        cfg = validate(config_from_dict(dict(base, **extra)), 1)
        measured = saved_bytes(cfg)
        ref = ref or measured
        estimate = activation_bytes(cfg, 0, "cpu", saved=models.saved_activations) / 2**20
        print(f"{name:<30} {measured / 2**20:>13.2f} {measured / ref:>8.2f} {estimate:>13.2f}")
    print("measured: kept from forward until backward (incl. the output head and loss, without the\n"
          "executor's loss mask and the recomputation replays); the estimate is the peak over forward and\n"
          "backward (megazero.planning.activations), replays and the executor's masked mean included.")


if __name__ == "__main__":
    main()
