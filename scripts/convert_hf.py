#!/usr/bin/env python
"""Convert between a Hugging Face directory (GPT-2, LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3,
Llama 4 (dense), Phi-3, OLMo 2, SmolLM3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, GLM-4.5,
DeepSeek-V3 with its MTP layers: docs/usage.md#hugging-face-models) and a megazero
training checkpoint, one tensor at a time (peak memory about one tensor plus a layer, not the model).

to-megazero: HF_DIR (save_pretrained) -> a checkpoint directory in the --save layout
    (latest_checkpointed_iteration.txt, iter_0000000/ with the model weights only), which
    pretrain_gpt.py reads under any TP/PP/DP/ZeRO layout:
        pretrain_gpt.py --load CKPT --finetune --use-checkpoint-args [data, parallel, optimizer flags]
to-hf: a --save directory of any run (any layout; the latest checkpoint, or --iteration N) ->
    HF_DIR that transformers.AutoModelForCausalLM.from_pretrained loads, in --dtype, cut into
    --max-shard-size safetensors files with an index.  When the run used a tokenizer (--tokenizer-model
    in its config, or given here) it goes into HF_DIR too, with generation_config.json, so
    transformers.pipeline("text-generation", HF_DIR) works.  A converted checkpoint keeps the source's
    tokenizer files and generation_config.json in CKPT/hf_files, and names them as its tokenizer.
    The source is checked first: its files must lie inside HF_DIR, config.json and the safetensors
    headers must be well-formed, every tensor the model needs must be there in the shape config.json
    implies, and every tensor there must be used (--allow-unused-weights drops the others); anything
    else is one line naming the file, exit status 2.

Examples:
  python scripts/convert_hf.py --direction to-megazero --input hf_gpt2/ --output ckpt_gpt2/
  python scripts/convert_hf.py --direction to-hf --input runs/demo/ckpt --output hf_demo/ --dtype bf16
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run from a checkout without installing

from megazero.errors import EXIT_OK, EXIT_USAGE  # noqa: E402 - after the path


def to_megazero(src: str, dst: str, allow_unused_weights: bool = False, notes=None) -> str:
    """HF directory ``src`` -> checkpoint directory ``dst`` (iteration 0, weights only), tensor by tensor."""
    from megazero.checkpoint import CheckpointError, latest_iteration
    from models.hf_convert import to_megazero as convert
    if not os.path.isdir(src):
        raise CheckpointError(f"--input {src}: no such directory (give a Hugging Face model directory, as "
                              "written by save_pretrained)")
    if latest_iteration(src) is not None:
        raise CheckpointError(f"--input {src} is a megazero checkpoint already: load it with --load, or "
                              "export it with --direction to-hf")
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise CheckpointError(f"--input {src}: no config.json, so not a Hugging Face model directory")
    return convert(src, dst, allow_unused_weights, notes)


def to_hf(src: str, dst: str, iteration=None, tokenizer=None, dtype: str = "fp32",
          max_shard_size: str = "5GB") -> str:
    """Checkpoint directory ``src`` -> HF directory ``dst``; returns a line describing what was written."""
    from models.hf_convert import to_hf as convert
    return convert(src, dst, iteration, tokenizer, dtype, max_shard_size)


def _return_freed_memory() -> None:
    """glibc: serve allocations of 4 MiB and more with their own mappings, returned to the system when
    freed, so one large tensor after another does not leave the heap grown (this process only)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD (a fixed threshold also stops glibc raising it)
    except (OSError, AttributeError):
        pass  # another C library: its own policy


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
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="to-hf: dtype of the exported weights (default fp32); to-megazero keeps fp32 master "
                   "weights whatever the source's")
    p.add_argument("--allow-unused-weights", action="store_true",
                   help="to-megazero: drop the tensors the model does not use (default: refuse them, "
                   "naming the first: weights that disagree with config.json, e.g. more layers than "
                   "num_hidden_layers)")
    p.add_argument("--max-shard-size", default="5GB", help="to-hf: largest safetensors file (e.g. 5GB, "
                   "500MB); a larger model is cut into model-0000i-of-0000N.safetensors with an index")
    args = p.parse_args(argv)
    if args.direction == "to-megazero" and args.dtype not in (None, "fp32"):
        p.error(f"--dtype {args.dtype} applies to --direction to-hf: a megazero checkpoint holds fp32 master "
                f"weights (training updates them); export with --direction to-hf --dtype {args.dtype}")
    try:
        from models.safetensors_io import parse_size
        if parse_size(args.max_shard_size) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--max-shard-size {args.max_shard_size}: give a size such as 5GB, 500MB or 1000000")
    from megazero.checkpoint import CheckpointError
    from megazero.config import ConfigError
    _return_freed_memory()
    try:
        if args.direction == "to-megazero":
            notes: list = []
            path = to_megazero(args.input, args.output, args.allow_unused_weights, notes)
            print(f"wrote {path}{''.join('; ' + n for n in notes)}: train it with pretrain_gpt.py --load "
                  f"{args.output} --finetune --use-checkpoint-args ...")
        else:
            print(to_hf(args.input, args.output, args.iteration, args.tokenizer_model, args.dtype or "fp32",
                        args.max_shard_size))
    except (CheckpointError, ConfigError, OSError) as err:
        print(f"convert_hf.py: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
