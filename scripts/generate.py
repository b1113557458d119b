#!/usr/bin/env python
"""Generate text with a trained checkpoint (any layout it was saved under).

    python scripts/generate.py --load runs/demo/ckpt --prompt "ROMEO:" --max-new-tokens 64
    python scripts/generate.py --load CKPT --prompt-ids 1,2,3 --json        # no tokenizer needed
    torchrun --nproc-per-node 2 scripts/generate.py --load CKPT --prompt "..."   # tensor parallel 2

Greedy by default (--temperature 0); --temperature T with --top-k K and --top-p P samples, from
--seed.  The tokenizer is the training run's --tokenizer-model unless --tokenizer-model is given.
--json prints {"ids": [prompt and generated ids], "prompt_ids": [...], "text": ...} (text null
without a tokenizer).  Under torchrun every rank holds a tensor-parallel shard; rank 0 prints.  A
mixture-of-experts checkpoint's experts are split over the ranks when their number allows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from megazero.errors import EXIT_OK, EXIT_USAGE  # noqa: E402 - after the path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True,
                   help="Checkpoint directory (pretrain_gpt.py --save, or converted).")
    p.add_argument("--iteration", type=int, help="Checkpoint iteration (default: the latest).")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="Prompt text (needs a tokenizer).")
    prompt.add_argument("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
    p.add_argument("--tokenizer-model", help="sentencepiece .model or Hugging Face tokenizer directory "
                   "(default: the training run's).")
    p.add_argument("--max-new-tokens", type=int, default=32, help="Tokens to generate.")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample.")
    p.add_argument("--top-k", type=int, default=0, help="Sample among the K most likely tokens (0: all).")
    p.add_argument("--top-p", type=float, default=1.0, help="Sample from the smallest set of tokens whose "
                   "probability reaches P (1: all).")
    p.add_argument("--seed", type=int, default=1234, help="Seed of the sampling generator.")
    p.add_argument("--stop-at-eod", action="store_true",
                   help="Stop at the tokenizer's end-of-document token.")
    p.add_argument("--json", action="store_true", help="Print one JSON object instead of the text.")
    return p.parse_args(argv)


def _tokenizer(args, saved_config):
    from megazero.data.tokenizer import load_tokenizer
    path = args.tokenizer_model or saved_config.get("data", {}).get("tokenizer_model")
    if not path:
        return None
    if not os.path.exists(path):
        raise ValueError(f"--tokenizer-model {path}: not found" + ("" if args.tokenizer_model else
                         " (the training run's; pass --tokenizer-model PATH)"))
    return load_tokenizer(path)


def _prompt_ids(args, tokenizer, vocab_size: int):
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError("--prompt needs a tokenizer: the training run had none; pass --tokenizer-model, "
                             "or give --prompt-ids")
        ids = tokenizer.encode(args.prompt)
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers") from None
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"--prompt-ids: {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def _expert_layout(args, tp: int) -> dict:
    """The expert layout of a mixture-of-experts checkpoint under ``tp`` ranks: the experts split over
    them (expert parallelism) when their number allows, each expert whole (expert TP 1, which biased
    experts need); none for a dense one."""
    from megazero.checkpoint.resolve import saved_config
    experts = (saved_config(args.load, args.iteration) or {}).get("moe", {}).get("num_experts")
    if not experts:
        return {}
    return {"ep": tp if experts % tp == 0 else 1, "etp": 1}


def run(args) -> dict:
    """Load, generate, and return the result (rank 0 prints it)."""
    import torch
    from megazero.mesh import ParallelMesh
    from megazero.training import init_distributed
    from models import generate
    from models.checkpoint import load_model
    created = init_distributed()
    try:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        mesh = ParallelMesh.build(tp=world, **_expert_layout(args, world)) if world > 1 else \
            ParallelMesh.single()
        model, info = load_model(args.load, args.iteration, mesh)
        tokenizer = _tokenizer(args, info["config"])
        ids = _prompt_ids(args, tokenizer, model.cfg.model.vocab_size)
        eos = tokenizer.eod if (args.stop_at_eod and tokenizer is not None) else None
        out = generate(model, torch.tensor([ids]), args.max_new_tokens, args.temperature, args.top_k,
                       args.top_p, args.seed, eos)[0].tolist()
    finally:
        if created:
            torch.distributed.destroy_process_group()
    text = tokenizer.decode(out) if tokenizer is not None else None
    return {"ids": out, "prompt_ids": ids, "text": text, "rank": mesh.rank,
            "using": (info["iteration"], info["path"], info["notes"])}


def main(argv=None) -> int:
    args = parse_args(argv)
    from megazero.checkpoint import CheckpointError
    from megazero.config import ConfigError
    try:
        result = run(args)
    except (ValueError, CheckpointError, ConfigError, OSError) as err:
        print(f"generate.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    iteration, path, notes = result.pop("using")
    if result.pop("rank") == 0:
        if notes:  # not the newest checkpoint: say which one and why
            print(f"generate.py: using iteration {iteration} ({path}), not the newest: {'; '.join(notes)}",
                  file=sys.stderr)
        if args.json:
            print(json.dumps(result))
        else:
            print(result["text"] if result["text"] is not None else " ".join(map(str, result["ids"])))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
