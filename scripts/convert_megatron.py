#!/usr/bin/env python
"""Convert a Megatron-LM checkpoint (torch_dist, or the legacy mp_rank_* format) into a megazero
checkpoint of weights, in one process, keeping its iteration, consumed samples and schedule position;
or (``--direction to-megatron``) a megazero checkpoint into Megatron-LM's torch_dist format, which
megatron-core's ``dist_checkpointing.load`` reads at any TP size::

    python scripts/convert_megatron.py --input MEGATRON_DIR --output OUT [--ckpt-step N]
    pretrain_gpt.py --load OUT --use-checkpoint-args [layout, data, optimizer flags]
    python scripts/convert_megatron.py --direction to-megatron --input MEGAZERO_DIR --output MEGATRON_DIR

``pretrain_gpt.py --load MEGATRON_DIR`` does the same at start-up (into MEGATRON_DIR/megazero_import);
this script is for a source directory the run cannot write to.  The model is Megatron-LM's stored
``args`` (architecture flags given here win).  Nothing in the files is executed (docs/migration.md).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megazero.errors import EXIT_OK, EXIT_USAGE  # noqa: E402 - after the path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a Megatron-LM --save directory (to-megazero), a megazero "
                   "checkpoint directory (to-megatron)")
    p.add_argument("--output", required=True, help="the directory to write")
    p.add_argument("--direction", choices=["to-megazero", "to-megatron"], default="to-megazero")
    p.add_argument("--ckpt-step", type=int, help="the iteration to convert (default: the latest)")
    p.add_argument("--ckpt-format", choices=["torch_dist", "torch"], help="the format expected "
                   "(default: detected)")
    args = p.parse_args(argv)
    from megazero.checkpoint import CheckpointError
    from megazero.checkpoint.megatron import convert, saved_config
    from megazero.config import ConfigError, config_from_dict, validate
    import models
    try:
        if args.direction == "to-megatron":
            from megazero.checkpoint.megatron.export import export
            path = export(args.input, args.output, args.ckpt_step)
            print(f"wrote {path}: Megatron-LM loads it with --load {args.output} --ckpt-format torch_dist "
                  "--no-load-optim --no-load-rng")
            return EXIT_OK
        model = saved_config(args.input, args.ckpt_step)["model"]
        cfg = validate(config_from_dict(dict(model, mock_data=True)), 1)
        path = convert(args.input, args.output, cfg, models.build_model, args.ckpt_step, args.ckpt_format)
    except (CheckpointError, ConfigError, OSError) as err:
        print(f"convert_megatron.py: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {path}: train it with pretrain_gpt.py --load {args.output} --use-checkpoint-args ...")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
