"""What a documented command line runs: each ``pretrain_gpt.py`` run it starts, with its world size.

:func:`pretrain_runs` turns one command (a token list from a fenced ``bash`` block) into
``(world_size, pretrain_gpt.py arguments)`` pairs:

- ``python scripts/pretrain_gpt.py ...`` / ``megazero-pretrain ...``: one rank, or ``WORLD_SIZE=N``;
- ``torchrun`` / ``python -m torch.distributed.run`` / ``scripts/launch.py`` / ``megazero-launch``:
  ``--nproc-per-node`` x ``--nnodes`` (both ends of an elastic ``MIN:MAX``);
- a shell launcher (``scripts/demo.sh``, ``launch/*.sh``, ``sbatch launch/slurm.sbatch``) runs under
  bash in a scratch directory, with ``python``, ``srun``, ``scontrol`` and ``nvidia-smi`` replaced by
  stubs (no GPU; ``python`` and ``srun`` write their arguments to a file and exit 0); the recorded
  torchrun command lines are read as above.  ``sbatch`` is played by setting SLURM's variables from
  its options and the script's ``#SBATCH`` lines.

:func:`make_stand_ins` writes small files where a command reads them: an indexed dataset for each
``--data-path`` prefix, a sentencepiece model or a Hugging Face tokenizer directory for
``--tokenizer-model``, and for ``--use-checkpoint-args`` a weights-only checkpoint of a small LLaMA.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN_NAMES = ("scripts/pretrain_gpt.py", "megazero-pretrain")
LAUNCHERS = ("torchrun", "torch.distributed.run", "scripts/launch.py", "megazero-launch")
SHELL_SCRIPT = re.compile(r"(?:^|/)(?:scripts|launch)/[\w.-]+\.(?:sh|sbatch)$")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)

# what the launchers read from the environment: only the documented command sets them here
LAUNCHER_ENV = {"NPROC", "NNODES", "NPROC_PER_NODE", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RUN_DIR",
                "MAX_RESTARTS", "NODE_RANK", "JOIN_TIMEOUT", "RDZV_ID", "MEGAZERO_ROOT", "WORLD_SIZE", "RANK"}
RECORD = 'f="$(mktemp "$MZ_CALLS/call.XXXXXX")"; printf "%s\\0" "$@" > "$f"; exit 0\n'
STUBS = {"python": RECORD, "python3": RECORD, "srun": RECORD, "torchrun": RECORD,
         "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then echo node0; fi; exit 0\n',
         "nvidia-smi": "exit 1\n"}


# files a launcher looks for before it starts pretrain_gpt.py, preparing them itself when they are
# missing (the demo fetches and tokenizes Shakespeare): stand-ins are made first (tokenizer, data prefix)
PREPARED = {"scripts/demo.sh": ("data/shakespeare-2k/tokenizer.model",
                                "data/shakespeare-2k/shakespeare_text_document")}


class CommandError(Exception):
    """A documented command whose runs cannot be worked out (the message says why)."""


def _is_pretrain(token: str) -> bool:
    return any(token == n or token.endswith("/" + n) for n in PRETRAIN_NAMES)


def _is_launcher(token: str) -> bool:
    return any(token == n or token.endswith("/" + n) for n in LAUNCHERS)


def env_and_rest(tokens: List[str]) -> Tuple[Dict[str, str], List[str]]:
    """``VAR=value`` assignments at the start of a command, and the rest."""
    env, i = {}, 0
    while i < len(tokens) and ASSIGNMENT.match(tokens[i]):
        name, value = ASSIGNMENT.match(tokens[i]).groups()
        env[name], i = value, i + 1
    return env, tokens[i:]


def _option(args: List[str], *names: str) -> Optional[str]:
    """The value of the last ``--name V`` / ``--name=V`` in ``args``."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1:]
    return found


def torchrun_worlds(launcher_args: List[str], what: str) -> List[int]:
    """World sizes of torchrun's own arguments (before the script): nproc per node x nodes."""
    nproc = _option(launcher_args, "--nproc-per-node", "--nproc_per_node") or "1"
    nnodes = _option(launcher_args, "--nnodes") or "1"
    if not nproc.isdigit():
        raise CommandError(f"{what}: --nproc-per-node {nproc} depends on the machine; give a number")
    ends = nnodes.split(":")
    if not all(e.isdigit() for e in ends):
        raise CommandError(f"{what}: --nnodes {nnodes} is not a number or MIN:MAX")
    return sorted({int(nproc) * int(e) for e in ends})


def _from_argv(argv: List[str], env: Dict[str, str], what: str) -> List[Tuple[int, List[str]]]:
    """The pretrain runs of one program's command line (after any environment assignments)."""
    script = next((i for i, t in enumerate(argv) if _is_pretrain(t)), None)
    if script is None:
        return []
    launcher = next((i for i, t in enumerate(argv[:script]) if _is_launcher(t)), None)
    args = argv[script + 1:]
    if launcher is None:
        world = env.get("WORLD_SIZE", "1")
        if not world.isdigit():
            raise CommandError(f"{what}: WORLD_SIZE={world} is not a number")
        return [(int(world), args)]
    return [(w, args) for w in torchrun_worlds(argv[launcher + 1:script], what)]


def _sbatch_env(argv: List[str], script: str) -> Dict[str, str]:
    """SLURM's variables for ``sbatch [options] script``: nodes and GPUs per node from the options,
    else from the script's ``#SBATCH`` lines."""
    with open(script) as f:
        directives = re.findall(r"^#SBATCH\s+(\S+)", f.read(), re.M)
    opts = [p for d in directives for p in d.split("=", 1)] + argv
    nodes = _option(opts, "--nodes", "-N") or "1"
    gpus = _option(opts, "--gpus-per-node") or "0"
    return {"SLURM_NNODES": nodes, "SLURM_GPUS_ON_NODE": gpus.split(":")[-1], "SLURM_JOB_ID": "1",
            "SLURM_JOB_NODELIST": "node0", "SLURM_SUBMIT_DIR": os.getcwd()}


def _run_shell(tokens: List[str], env: Dict[str, str], scratch: str, what: str) -> List[List[str]]:
    """Run a shell launcher under bash with stubbed programs; the argument lists recorded."""
    bin_dir, calls = os.path.join(scratch, "bin"), os.path.join(scratch, "calls")
    os.makedirs(bin_dir, exist_ok=True)
    shutil.rmtree(calls, ignore_errors=True)
    os.makedirs(calls)
    for name, body in STUBS.items():
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + body)
        os.chmod(path, 0o755)
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith(("SLURM_",
                                                                                                 "DEMO_"))}
    run_env.update(env, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                   PYTHON=os.path.join(bin_dir, "python"), MZ_CALLS=calls)
    if tokens[0] in ("bash", "sh"):
        tokens = tokens[1:]
    if tokens[0] == "sbatch":
        at = next(i for i, t in enumerate(tokens) if t.endswith(".sbatch"))
        run_env.update(_sbatch_env(tokens[1:at], os.path.join(ROOT, tokens[at])))
        tokens = tokens[at:]
    script = tokens[0]
    if script.endswith("scripts/demo.sh"):  # it works in its own checkout: give it the scratch one
        os.makedirs(os.path.join(scratch, "scripts"), exist_ok=True)
        shutil.copy(os.path.join(ROOT, "scripts", "demo.sh"), os.path.join(scratch, "scripts", "demo.sh"))
        path = os.path.join(scratch, "scripts", "demo.sh")
    else:
        path = os.path.join(ROOT, script)
    done = subprocess.run(["bash", path] + tokens[1:], cwd=scratch, env=run_env, capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        raise CommandError(f"{what}: exited {done.returncode} under bash with stubbed programs:\n"
                           f"{done.stderr[-2000:]}")
    recorded = []
    for name in sorted(os.listdir(calls)):
        with open(os.path.join(calls, name)) as f:
            recorded.append(f.read().split("\0")[:-1])
    return recorded


def starts_training(script: str) -> bool:
    """Whether a shell script's code (not its comments) names pretrain_gpt.py: only those run here
    (another, such as scripts/test.sh, may install packages)."""
    with open(os.path.join(ROOT, script)) as f:
        return any("pretrain_gpt.py" in line.split("#", 1)[0] for line in f)


def pretrain_runs(tokens: List[str], scratch: str) -> List[Tuple[int, List[str]]]:
    """``(world size, pretrain_gpt.py arguments)`` of each training run the command starts (none for a
    command that starts none).  Shell launchers run in ``scratch`` (their relative paths land there)."""
    what = " ".join(tokens)
    env, rest = env_and_rest(tokens)
    if not rest:
        return []
    shell = next((t for t in rest if SHELL_SCRIPT.search(t)), None)
    if shell is None or not (rest[0] in ("bash", "sh", "sbatch") or rest[0] == shell):
        return _from_argv(rest, env, what)
    if not starts_training(shell):
        return []  # e.g. scripts/test.sh: nothing here runs it
    prepared = next((files for name, files in PREPARED.items() if shell.endswith(name)), ())
    if prepared:
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            make_stand_ins(["--tokenizer-model", prepared[0], "--data-path", prepared[1]])
        finally:
            os.chdir(cwd)
    runs = []
    for argv in _run_shell(rest, env, scratch, what):
        runs += _from_argv(argv, {}, what)
    if not runs:
        raise CommandError(f"{what}: the launcher started no pretrain_gpt.py run under the stubs")
    return runs


# ---- stand-ins for the files a documented command reads -----------------------------------------

TEXT = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
        "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"]


def _sentencepiece(path: str) -> None:
    import sentencepiece as spm
    corpus = path + ".txt"
    with open(corpus, "w") as f:
        f.write("\n".join(TEXT * 10))
    spm.SentencePieceTrainer.Train(input=corpus, model_prefix=path[:-len(".model")], vocab_size=64,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    os.remove(corpus)
    os.remove(path[:-len(".model")] + ".vocab")


def _hf_tokenizer(directory: str) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT * 10, vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"])
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(directory)


def _dataset(prefix: str, vocab: int) -> None:
    import numpy as np
    from megazero.data.indexed import IndexedDatasetWriter
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix) as w:
        for _ in range(64):
            w.add_document(rng.integers(0, vocab, size=600).tolist())


def _conversations(path: str) -> None:
    """The repo's example conversations (scripts/examples/sft_shakespeare.jsonl) at ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    shutil.copy(os.path.join(ROOT, "scripts", "examples", "sft_shakespeare.jsonl"), path)


def _checkpoint(directory: str, args: List[str]) -> None:
    """A weights-only checkpoint of a small LLaMA (4 layers, 8 heads, 4 query groups: fits TP, PP and
    CP up to 4) whose vocabulary is the command's tokenizer's."""
    import torch
    from megazero.checkpoint import save_weights
    from megazero.config import config_from_dict, validate
    from megazero.mesh import ParallelMesh
    import models
    settings = dict(models.PRESETS["tiny-llama"], num_layers=4, hidden_size=64, num_attention_heads=8,
                    num_query_groups=4,
                    max_position_embeddings=max(int(_option(args, "--seq-length") or 0), 256),
                    mock_data=True, hidden_dropout=0.0, attention_dropout=0.0)
    tokenizer = _option(args, "--tokenizer-model")
    if tokenizer:
        settings["tokenizer_model"] = os.path.abspath(tokenizer)
    cfg = validate(config_from_dict(settings), 1)
    torch.manual_seed(0)
    save_weights(directory, [models.build_model(cfg)], ParallelMesh.single(), cfg)


def make_stand_ins(args: List[str]) -> List[str]:
    """Create (in the working directory) the files ``args`` read that are not there; returns them."""
    made = []
    tokenizer = _option(args, "--tokenizer-model")
    if tokenizer and not os.path.exists(tokenizer):
        os.makedirs(os.path.dirname(tokenizer.rstrip("/")) or ".", exist_ok=True)
        if tokenizer.endswith(".model"):
            _sentencepiece(tokenizer)
        else:
            _hf_tokenizer(tokenizer)
        made.append(tokenizer)
    vocab = 64 if tokenizer else 256
    prefixes = []
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        if flag in args:
            i = args.index(flag) + 1
            while i < len(args) and not args[i].startswith("--"):
                if not re.fullmatch(r"[0-9.eE+-]+", args[i]):
                    prefixes.append(args[i])
                i += 1
    listed = _option(args, "--data-args-path")  # docs/data.md: the items from files
    if listed and not os.path.exists(listed):
        with open(listed, "w") as fh:
            fh.write("0.7 stand_in_a_text_document 0.3 stand_in_b_text_document\n")
        prefixes += ["stand_in_a_text_document", "stand_in_b_text_document"]
        made.append(listed)
    splits = _option(args, "--per-split-data-args-path")
    if splits and not os.path.exists(splits):
        sets = {"train": ["stand_in_a_text_document"], "test": ["stand_in_b_text_document"],
                "valid": [f"stand_in_v{i}_text_document" for i in range(2)]}
        with open(splits, "w") as fh:
            json.dump(sets, fh)
        prefixes += [p for items in sets.values() for p in items]
        made.append(splits)
    for prefix in prefixes:
        if "--sft" in args:  # JSON-lines conversations (docs/sft.md)
            if not os.path.exists(prefix):
                _conversations(prefix)
                made.append(prefix)
        elif not os.path.exists(prefix + ".idx"):
            _dataset(prefix, vocab)
            made.append(prefix)
    load = _option(args, "--load")
    if load and "--use-checkpoint-args" in args and not os.path.exists(load):
        _checkpoint(load, args)
        made.append(load)
    return made
