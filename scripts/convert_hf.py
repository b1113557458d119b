#!/usr/bin/env python
"""Convert between a Hugging Face GPT-2 / LLaMA directory and a megazero training checkpoint.

to-megazero: HF_DIR (save_pretrained) -> a checkpoint directory in the --save layout
    (latest_checkpointed_iteration.txt, iter_0000000/ with the model weights only), which
    pretrain_gpt.py reads under any TP/PP/DP/ZeRO layout:
        pretrain_gpt.py --load CKPT --finetune --use-checkpoint-args [data, parallel, optimizer flags]
to-hf: a --save directory of any run (any layout; the latest checkpoint, or --iteration N) ->
    HF_DIR that transformers.AutoModelForCausalLM.from_pretrained loads.  When the run used a
    tokenizer (--tokenizer-model in its config, or given here) it goes into HF_DIR too, so
    transformers.pipeline("text-generation", HF_DIR) works.

Examples:
  python scripts/convert_hf.py --direction to-megazero --input hf_gpt2/ --output ckpt_gpt2/
  python scripts/convert_hf.py --direction to-hf --input runs/demo/ckpt --output hf_demo/
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing


def to_megazero(src: str, dst: str) -> str:
    """HF directory ``src`` -> checkpoint directory ``dst`` (iteration 0, weights only)."""
    from megazero.checkpoint import CheckpointError, latest_iteration, save_weights
    from megazero.mesh import ParallelMesh
    from models.hf import from_hf
    if not os.path.isdir(src):
        raise CheckpointError(f"--input {src}: no such directory (give a Hugging Face model directory, as "
                              "written by save_pretrained)")
    if latest_iteration(src) is not None:
        raise CheckpointError(f"--input {src} is a megazero checkpoint already: load it with --load, or "
                              "export it with --direction to-hf")
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise CheckpointError(f"--input {src}: no config.json, so not a Hugging Face model directory")
    model = from_hf(src)
    return save_weights(dst, [model], ParallelMesh.single(), model.cfg, iteration=0,
                        extra={"converted_from": os.path.abspath(src)})


def to_hf(src: str, dst: str, iteration=None, tokenizer=None) -> str:
    """Checkpoint directory ``src`` -> HF directory ``dst``; returns a line describing what was written."""
    from models.checkpoint import load_model
    from models.hf import export_tokenizer, to_hf as write_hf
    model, info = load_model(src, iteration, flag="--input")
    write_hf(model, dst)
    line = f"wrote {dst} from {info['path']} (iteration {info['iteration']})"
    tokenizer = tokenizer or info["config"].get("data", {}).get("tokenizer_model")
    if not tokenizer:
        return line + "; no tokenizer (the run had none: pass --tokenizer-model to add one)"
    if not os.path.exists(tokenizer):
        return line + f"; tokenizer {tokenizer} not found from here (pass --tokenizer-model PATH)"
    try:
        tok = export_tokenizer(tokenizer, dst)
    except ValueError as err:
        return line + f"; tokenizer not exported: {err}"
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(dst)  # the tokenizer's special ids in the model's config
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    config.save_pretrained(dst)
    return line + f" with tokenizer {tokenizer} ({type(tok).__name__})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="to-megazero: a Hugging Face model directory; to-hf: a "
                   "checkpoint directory (pretrain_gpt.py --save, or a converted one)")
    p.add_argument("--output", required=True, help="destination directory (created)")
    p.add_argument("--direction", required=True, choices=["to-megazero", "to-hf"],
                   help="to-megazero: HF dir -> checkpoint; to-hf: checkpoint -> HF dir")
    p.add_argument("--iteration", type=int, help="to-hf: export this iteration (default: the latest)")
    p.add_argument("--tokenizer-model", help="to-hf: the tokenizer to put beside the model (default: the "
                   "training run's --tokenizer-model)")
    args = p.parse_args(argv)
    from megazero.checkpoint import CheckpointError
    from megazero.config import ConfigError
    try:
        if args.direction == "to-megazero":
            path = to_megazero(args.input, args.output)
            print(f"wrote {path}: train it with pretrain_gpt.py --load {args.output} --finetune "
                  "--use-checkpoint-args ...")
        else:
            print(to_hf(args.input, args.output, args.iteration, args.tokenizer_model))
    except (CheckpointError, ConfigError, OSError) as err:
        print(f"convert_hf.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
