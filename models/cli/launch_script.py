"""``plan.py --emit-launch slurm|torchrun``: the launch script of a planned layout.

The script runs this repository's launchers (``launch/slurm.sbatch`` inside the allocation the
``#SBATCH`` lines request, or ``launch/run_multinode.sh`` on every node) with every flag of the
layout.  Data flags are the user's: ``DATA_ARGS`` (default ``--mock-data``), and anything given to
the script is passed on to ``pretrain_gpt.py``.  ``MEGAZERO_ROOT`` defaults to the checkout that
wrote the script.
"""
from __future__ import annotations

import os
import shlex
from typing import Sequence

KINDS = ("slurm", "torchrun")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch_script(kind: str, flags: Sequence[str], gpus: int, gpus_per_node: int, summary: str) -> str:
    """The text of a ``kind`` launch script for ``gpus`` GPUs running ``pretrain_gpt.py flags``."""
    if kind not in KINDS:
        raise ValueError(f"--emit-launch {kind!r}: choose one of {', '.join(KINDS)}")
    nodes, per_node = max(1, gpus // gpus_per_node), min(gpus, gpus_per_node)
    pairs, i = [], 0
    while i < len(flags):  # one flag and its value a line
        take = 2 if i + 1 < len(flags) and not flags[i + 1].startswith("--") else 1
        pairs.append(" ".join(shlex.quote(f) for f in flags[i:i + take]))
        i += take
    args = " \\\n  ".join(pairs)
    head = ["#!/usr/bin/env bash",
            f"# Written by plan.py: {summary}",
            f"# {nodes} node(s) x {per_node} GPU(s). Data: DATA_ARGS (default --mock-data); extra",
            "# pretrain_gpt.py flags may follow on the command line."]
    if kind == "slurm":
        head += ["#SBATCH --job-name=megazero", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --gpus-per-node={per_node}", "#SBATCH --exclusive", "#SBATCH --signal=USR1@300",
                 "#SBATCH --output=megazero-%j.out"]
    body = ["set -euo pipefail",
            f'root="${{MEGAZERO_ROOT:-{ROOT}}}"',
            'read -r -a data <<< "${DATA_ARGS:---mock-data}"']
    if kind == "slurm":
        body.append(f'exec bash "$root/launch/slurm.sbatch" \\\n  {args} \\\n  "${{data[@]}}" "$@"')
    else:
        master = ('"${MASTER_ADDR:-localhost}"' if nodes == 1
                  else '"${MASTER_ADDR:?set MASTER_ADDR to node 0}"')
        body.append(f'exec bash "$root/launch/run_multinode.sh" --nnodes {nodes} --nproc-per-node {per_node} '
                    f'--master-addr {master} -- \\\n  {args} \\\n  "${{data[@]}}" "$@"')
    return "\n".join(head + body) + "\n"


def script_flags(text: str) -> list:
    """The ``pretrain_gpt.py`` flags an emitted script passes (for checking it)."""
    line = text.split("exec bash ", 1)[1].replace("\\\n", " ")
    words = shlex.split(line.split('"${data[@]}"')[0])
    return words[words.index("--") + 1:] if "--" in words else words[1:]
