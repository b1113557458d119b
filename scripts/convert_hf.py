#!/usr/bin/env python
"""Convert between a Hugging Face GPT-2 / LLaMA directory and a megazero weights directory.

The megazero side is a directory with
  model.pt     torch.save'd dict: megazero parameter name -> full tensor (unsharded, vocabulary
               unpadded; names as in models.gpt.GPTModel, e.g. decoder.0.attention.qkv.weight)
  config.json  {"model": {ModelConfig fields}}; usable as --config for scripts/pretrain_gpt.py

Examples:
  python scripts/convert_hf.py --direction to-megazero --input hf_gpt2/ --output mz_gpt2/
  python scripts/convert_hf.py --direction to-hf --input mz_gpt2/ --output hf_again/
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, fields

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.config import ModelConfig, config_from_dict, validate  # noqa: E402


def model_settings(cfg) -> dict:
    """The (non-derived) ModelConfig fields of a config."""
    derived = {f.name for f in fields(ModelConfig) if f.metadata.get("derived")}
    return {k: v for k, v in asdict(cfg.model).items() if k not in derived}


def to_megazero(src: str, dst: str) -> None:
    from models.gpt import full_state_dict
    from models.hf import from_hf
    model = from_hf(src)
    os.makedirs(dst, exist_ok=True)
    torch.save(full_state_dict(model), os.path.join(dst, "model.pt"))
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump({"model": model_settings(model.cfg)}, fh, indent=2)


def to_hf(src: str, dst: str) -> None:
    from models import build_model
    from models.gpt import load_full_state_dict
    from models.hf import to_hf as write_hf
    with open(os.path.join(src, "config.json")) as fh:
        settings = json.load(fh)["model"]
    cfg = validate(config_from_dict(dict(settings, mock_data=True)), 1)
    model = build_model(cfg)
    load_full_state_dict(model, torch.load(os.path.join(src, "model.pt"), map_location="cpu"))
    write_hf(model, dst)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="source directory (HF model dir or megazero weights dir)")
    p.add_argument("--output", required=True, help="destination directory (created)")
    p.add_argument("--direction", required=True, choices=["to-megazero", "to-hf"],
                   help="to-megazero: HF dir -> model.pt + config.json; to-hf: the reverse")
    args = p.parse_args(argv)
    (to_megazero if args.direction == "to-megazero" else to_hf)(args.input, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
