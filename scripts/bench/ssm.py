#!/usr/bin/env python
"""A Mamba-2 layer and a Gated DeltaNet layer beside an attention layer of the same width, one process,
as the sequence grows (measured, not asserted).

Each layer is one block of a hybrid stack (:class:`megazero_models.hybrid.HybridLayer`: norm, mixer,
residual) built from the same settings; per sequence length it times forward + backward of one
micro-batch (the best of ``--repeats``) and counts the bytes of the distinct tensors autograd saves
for backward (saved-tensor hooks; parameters excluded).

    python scripts/bench_ssm.py [--hidden-size 256 --seq-lengths 1024 4096 16384 --json -]
"""
import argparse
import sys
import time

import torch

from megazero.config import config_from_dict, validate
from megazero.errors import EXIT_OK
from megazero.mesh import ParallelMesh
from megazero.tensor_parallel.rng import RNGTracker
from megazero_models.hybrid import HybridLayer
from bench.timing import timed_backward

KINDS = {"M": "Mamba-2", "G": "Gated DeltaNet", "*": "attention"}


def layer_cfg(args, seq: int):
    """One-layer settings of kind-agnostic sizes: attention heads of 64 channels, Mamba-2 with
    Megatron-LM's head count (2 x hidden / 64), Gated DeltaNet with heads of 64 channels."""
    heads = args.hidden_size // 64
    return dict(mock_data=True, num_layers=1, hidden_size=args.hidden_size, num_attention_heads=heads,
                seq_length=seq, position_embedding_type="none", normalization="RMSNorm",
                add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, micro_batch_size=1,
                global_batch_size=1, mamba_head_dim=64, mamba_state_dim=args.state_dim,
                mamba_num_groups=1, mamba_chunk_size=args.chunk_size, linear_num_key_heads=heads,
                linear_num_value_heads=heads, linear_key_head_dim=64, linear_value_head_dim=64,
                linear_chunk_size=args.chunk_size)


def measure(kind: str, seq: int, args) -> dict:
    settings = dict(layer_cfg(args, seq), hybrid_layer_pattern=kind)
    if args.selective:  # attention replays its core, the mixers their conv, scan and norm
        settings["recompute_granularity"] = "selective"
    cfg = validate(config_from_dict(settings), world_size=1)
    mesh = ParallelMesh.single()
    torch.manual_seed(0)
    layer = HybridLayer(cfg, mesh, 0, RNGTracker(0, 0, mesh.device))
    x = torch.randn(seq, 1, args.hidden_size, requires_grad=True)
    seconds, saved = timed_backward(lambda: layer(x), layer, x, args.repeats)
    return dict(kind=KINDS[kind], seq=seq, seconds=seconds, saved_bytes=saved)


def measure_decode(kind: str, seq: int, args) -> dict:
    """Seconds per generated token after a ``seq``-token prompt (the layer's cache: keys and values
    for attention, conv and recurrent state for Mamba-2 and Gated DeltaNet), the best of 8 tokens."""
    from megazero_models.layers import KVCache
    cfg = validate(config_from_dict(dict(layer_cfg(args, seq + 8), hybrid_layer_pattern=kind)), world_size=1)
    mesh = ParallelMesh.single()
    torch.manual_seed(0)
    layer = HybridLayer(cfg, mesh, 0, RNGTracker(0, 0, mesh.device)).eval()
    cache, times = KVCache(), []
    with torch.no_grad():
        layer(torch.randn(seq, 1, args.hidden_size), kv_cache=cache)
        cache.length = seq
        for _ in range(8):
            start = time.perf_counter()
            layer(torch.randn(1, 1, args.hidden_size), kv_cache=cache)
            times.append(time.perf_counter() - start)
            cache.length += 1
    return dict(kind=KINDS[kind], seq=seq, decode_seconds=min(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--state-dim", type=int, default=64, help="Mamba-2 state size per head")
    p.add_argument("--chunk-size", type=int, default=128, help="chunk of the SSD scan and the delta rule")
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--kinds", nargs="+", default=["M", "G", "*"], choices=sorted(KINDS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--selective", action="store_true", help="--recompute-granularity selective")
    p.add_argument("--decode", action="store_true", help="time one generated token after each length's "
                   "prompt instead of training's forward + backward")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="hidden 64, sequences 64 and 128, one repeat")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    args = p.parse_args(argv)
    if args.hidden_size % 64:
        p.error(f"--hidden-size {args.hidden_size} must be a multiple of 64 (heads of 64 channels)")
    if args.quick:
        args.hidden_size, args.seq_lengths, args.repeats, args.chunk_size = 64, [64, 128], 1, 32
    torch.set_num_threads(args.threads)
    if args.decode:
        rows = [measure_decode(kind, seq, args) for seq in args.seq_lengths for kind in args.kinds]
        print(f"hidden {args.hidden_size}, batch 1, fp32, {torch.get_num_threads()} thread(s): one token "
              "through one layer after a prompt of each length")
        print(f"{'layer':<16}{'prompt':>7}{'ms/token':>10}")
        for r in rows:
            print(f"{r['kind']:<16}{r['seq']:>7}{r['decode_seconds'] * 1e3:>10.3f}")
        if args.json:
            from bench import write_json
            write_json(rows, args.json)
        return EXIT_OK
    rows = [measure(kind, seq, args) for seq in args.seq_lengths for kind in args.kinds]
    print(f"hidden {args.hidden_size}, batch 1, fp32, {torch.get_num_threads()} thread(s): forward + "
          "backward of one layer (norm, mixer, residual)"
          + (", selective recompute" if args.selective else ""))
    print(f"{'layer':<16}{'seq':>7}{'fwd+bwd s':>11}{'saved MiB':>11}")
    for r in rows:
        print(f"{r['kind']:<16}{r['seq']:>7}{r['seconds']:>11.3f}{r['saved_bytes'] / 2 ** 20:>11.1f}")
    if args.json:
        from bench import write_json
        write_json(rows, args.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
