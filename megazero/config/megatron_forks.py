"""Flags of projects built on Megatron-LM whose public launch scripts call ``pretrain_gpt.py`` with a few
flags of their own: Swallow's fork (okoge-kaz/Megatron-LM) and MindSpeed-LLM (Ascend).  Each is
answered with its project's meaning where megazero has that meaning, named at start-up when it changes
nothing here, and refused by name otherwise (:func:`fork_rules`, called by
:func:`megazero.config.megatron.translate`)."""
from __future__ import annotations

import os
from typing import Any, Dict, List

# flag -> the megazero setting it sets, with that setting's values (argparse dest: the setting)
FORK_ALIASES: Dict[str, str] = {
    # Swallow's Llama 3.1 RoPE scaling companions (its --rope-factor turns the scaling on)
    "--rope-low-freq-factor": "rope_scaling_low_freq_factor",
    "--rope-high-freq-factor": "rope_scaling_high_freq_factor",
    "--rope-original-max-positional-embeddings": "rope_scaling_original_max_position_embeddings",
    "--wandb-name": "wandb_exp_name",  # Swallow's name of the wandb run
    "--tokenizer-name-or-path": "tokenizer_model",  # MindSpeed-LLM's Hugging Face tokenizer directory
}

FORK_SPECIAL: Dict[str, Dict[str, Any]] = {
    "--rope-factor": dict(type=float, help="Swallow's fork: LLaMA-3.1 RoPE scaling with this factor (= "
                          "--use-rope-scaling --rope-scaling-factor F; its companions "
                          "--rope-low-freq-factor, --rope-high-freq-factor, "
                          "--rope-original-max-positional-embeddings)."),
    "--use-mpi": dict(action="store_true", help="Swallow's fork: ranks from Open MPI's OMPI_COMM_WORLD_* "
                      "variables. Accepted where the launcher sets RANK / WORLD_SIZE / LOCAL_RANK "
                      "(torchrun)."),
    "--use-z-loss": dict(action="store_true", help="Swallow's fork: a z-loss on the output logits, 1e-4 x "
                         "log(sum exp(logits))^2 per token added to the loss (= --z-loss-coeff 1e-4)."),
    "--handler-name": dict(nargs="*", help="MindSpeed-LLM's data-preprocessing handler: no effect on "
                           "pretraining (ids are already encoded)."),
    "--enable-hf2mg-convert": dict(action="store_true", help="MindSpeed-LLM: convert the Hugging Face "
                                   "weights in --load at start-up. Accepted when --load holds none "
                                   "(nothing to convert); otherwise convert first with "
                                   "scripts/convert_hf.py."),
    "--model-type-hf": dict(nargs="*", help="MindSpeed-LLM: the Hugging Face model type of "
                            "--enable-hf2mg-convert."),
}

# tokenizer types of these projects that are a Hugging Face tokenizer directory here
HF_TOKENIZER_ALIASES: Dict[str, str] = {
    "PretrainedFromHF": "MindSpeed-LLM's Hugging Face tokenizer (--tokenizer-name-or-path)",
    "PretrainedFormHF": "MindSpeed-LLM's Hugging Face tokenizer, as some of its scripts spell it",
    "Llama3Tokenizer": "Swallow's Llama 3 tokenizer; its tiktoken-format file is not read here: "
                       "--tokenizer-model names the Hugging Face directory of the same tokenizer "
                       "(meta-llama/Llama-3.1-8B's tokenizer.json)",
}

Z_LOSS_COEFF = 1e-4  # Swallow's fork: megatron/core/tensor_parallel/cross_entropy.py


def _hf_weights(path: str) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "config.json")) and any(
        n.endswith((".safetensors", ".bin")) for n in os.listdir(path))


def fork_rules(given: Dict[str, Any], out: Dict[str, Any], notes: List[str], ignored: List[str],
               problems: List[str]) -> None:
    """The rules of :data:`FORK_SPECIAL` and the tokenizer types of :data:`HF_TOKENIZER_ALIASES`."""
    if given.get("--rope-factor") is not None:
        out["use_rope_scaling"], out["rope_scaling_factor"] = True, given["--rope-factor"]
        notes.append(f"--rope-factor {given['--rope-factor']}: LLaMA-3.1 RoPE scaling (= --use-rope-scaling "
                     f"--rope-scaling-factor {given['--rope-factor']}, Swallow's meaning)")
    if given.get("--use-mpi"):
        if "OMPI_COMM_WORLD_SIZE" in os.environ and "RANK" not in os.environ:
            problems.append("--use-mpi: under mpirun set RANK, LOCAL_RANK and WORLD_SIZE from "
                            "OMPI_COMM_WORLD_RANK / _LOCAL_RANK / _SIZE (and MASTER_ADDR, MASTER_PORT) "
                            "before megazero starts, or launch with torchrun")
        else:
            ignored.append("--use-mpi (the ranks come from RANK / WORLD_SIZE / LOCAL_RANK, which the "
                           "launcher set)")
    if given.get("--use-z-loss"):
        if out.get("z_loss_coeff") not in (None, Z_LOSS_COEFF):
            problems.append(f"--use-z-loss means --z-loss-coeff {Z_LOSS_COEFF}, but {out['z_loss_coeff']} is "
                            "given too; drop one")
        out["z_loss_coeff"] = Z_LOSS_COEFF
        notes.append(f"--use-z-loss: a z-loss on the output logits (= --z-loss-coeff {Z_LOSS_COEFF}, "
                     "Swallow's meaning), included in the loss reported")
    if out.get("z_loss_coeff") and out.get("mtp_num_layers"):
        problems.append("--z-loss-coeff (or --use-z-loss) with --mtp-num-layers is not implemented (the "
                        "z-loss acts on the main output head's loss only); drop one")
    if given.get("--handler-name") is not None:
        ignored.append(f"--handler-name {' '.join(given['--handler-name'])} (MindSpeed-LLM's preprocessing "
                       "handler: training reads ids already encoded)")
    if given.get("--enable-hf2mg-convert") or given.get("--model-type-hf") is not None:
        load = out.get("load")
        if _hf_weights(load):
            problems.append(f"--enable-hf2mg-convert: {load} holds Hugging Face weights, which are not "
                            "converted at start-up here; convert them first (scripts/convert_hf.py "
                            "--direction to-megazero) and --load the result")
        else:
            ignored.append("--enable-hf2mg-convert / --model-type-hf (MindSpeed-LLM's start-up conversion of "
                           "Hugging Face weights in --load: there are none to convert)")
    kind = out.get("tokenizer_type")
    if kind in HF_TOKENIZER_ALIASES:
        out["tokenizer_type"] = "HuggingFaceTokenizer"
        model = out.get("tokenizer_model")
        if model and os.path.isfile(model):
            problems.append(f"--tokenizer-type {kind} --tokenizer-model {model}: a tokenizer file (tiktoken "
                            "or sentencepiece) is not read as this type; give the Hugging Face directory of "
                            "the same tokenizer (its tokenizer.json)")
        notes.append(f"--tokenizer-type {kind}: a Hugging Face tokenizer directory "
                     f"(= HuggingFaceTokenizer; {HF_TOKENIZER_ALIASES[kind]})")
