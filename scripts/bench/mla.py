#!/usr/bin/env python
"""Multi-latent attention beside standard attention of the same width, one process (measured, not
asserted).

Both are one transformer layer's attention half (:class:`megazero_models.layers.TransformerLayer`
without its MLP: norm, attention, residual) with the same heads and the same query/key width a head
(standard attention: multi-head, ``kv_channels = qk_head_dim + qk_pos_emb_head_dim``, values of that
width too; MLA: ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim`` and the two latents).
Per sequence length: forward + backward of one micro-batch (the best of ``--repeats``), per token,
and the bytes of the distinct tensors autograd saves for backward (saved-tensor hooks; parameters and
the input excluded), per token; then the generation cache: what a prompt of that length leaves in
:class:`megazero_models.layers.KVCache` per token and layer (MLA: the latent and the rotary key;
standard attention: keys and values), read off the storage of the cache's tensors after a prompt of
``seq - 1`` tokens and one generated token.

    python scripts/bench_mla.py [--hidden-size 1024 --heads 8 --seq-lengths 1024 4096 --json -]
"""
import argparse
import sys

import torch

from megazero.config import config_from_dict, validate
from megazero.errors import EXIT_OK
from megazero.mesh import ParallelMesh
from megazero.tensor_parallel.rng import RNGTracker
from megazero_models.gpt import GPTModel
from megazero_models.layers import KVCache
from bench.timing import timed_backward


def layer_cfg(args, seq: int, mla: bool):
    q_width = args.qk_head_dim + args.pos_dim
    common = dict(mock_data=True, num_layers=1, hidden_size=args.hidden_size, num_attention_heads=args.heads,
                  seq_length=seq, max_position_embeddings=seq, vocab_size=128,
                  position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                  activation="swiglu", ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                  micro_batch_size=1, global_batch_size=1)
    if not mla:
        return validate(config_from_dict(dict(common, kv_channels=q_width)), world_size=1)
    return validate(config_from_dict(dict(
        common, multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.pos_dim, v_head_dim=args.v_head_dim,
        qk_layernorm=True)), world_size=1)


def measure(mla: bool, seq: int, args) -> dict:
    cfg = layer_cfg(args, seq, mla)
    torch.manual_seed(0)
    model = GPTModel(cfg, ParallelMesh.single(), range(1), True, False, RNGTracker(0, 0, torch.device("cpu")))
    layer = model.decoder["0"]
    x = torch.randn(seq, 1, args.hidden_size, requires_grad=True)
    rope = model._rope(x)

    def attention_half():
        return x + layer.attention(layer.input_norm(x), rope)

    seconds, saved = timed_backward(attention_half, layer, x, args.repeats)
    cache, h = KVCache(), layer.input_norm(x.detach())
    with torch.no_grad():  # a prompt of seq - 1 tokens, then one generated token (the cache grows by a copy)
        layer.attention(h[:-1], model._rope(h[:-1]), cache)
        cache.length = seq - 1
        layer.attention(h[-1:], model._rope(h[-1:], offset=seq - 1), cache)
    cache_bytes = sum(t.untyped_storage().nbytes() for t in (*cache.keys.values(), *cache.values.values()))
    return dict(kind="MLA" if mla else "standard", seq=seq, us_per_token=1e6 * seconds / seq,
                saved_bytes_per_token=saved / seq, cache_bytes_per_token=cache_bytes / seq,
                params=sum(p.numel() for p in layer.attention.parameters()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--pos-dim", type=int, default=64, help="--qk-pos-emb-head-dim")
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--q-lora-rank", type=int, default=384)
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="hidden 64, 4 heads, sequences 32 and 64, one repeat")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON ('-': stdout)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden_size, args.heads, args.qk_head_dim, args.pos_dim, args.v_head_dim = 64, 4, 16, 8, 16
        args.q_lora_rank, args.kv_lora_rank, args.seq_lengths, args.repeats = 24, 16, [32, 64], 1
    if args.pos_dim % 2:
        p.error(f"--pos-dim {args.pos_dim} must be even (RoPE rotates pairs)")
    torch.set_num_threads(args.threads)
    rows = [measure(mla, seq, args) for seq in args.seq_lengths for mla in (False, True)]
    print(f"hidden {args.hidden_size}, {args.heads} heads of {args.qk_head_dim}+{args.pos_dim} (values "
          f"{args.v_head_dim} for MLA), latents {args.q_lora_rank}/{args.kv_lora_rank}, batch 1, fp32, "
          f"{torch.get_num_threads()} thread(s): norm + attention + residual, forward + backward")
    print(f"{'attention':<10}{'seq':>7}{'params':>10}{'us/token':>10}{'saved KiB/token':>17}"
          f"{'cache B/token':>15}")
    for r in rows:
        print(f"{r['kind']:<10}{r['seq']:>7}{r['params']:>10}{r['us_per_token']:>10.1f}"
              f"{r['saved_bytes_per_token'] / 1024:>17.2f}{r['cache_bytes_per_token']:>15.0f}")
    if args.json:
        from bench import write_json
        write_json(rows, args.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
