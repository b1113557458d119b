"""What a checkpoint is made of: its file names, and what its metadata records about the model,
the layout and the schedule.  Pure functions of the settings and the model; this module imports
nothing else of megazero."""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

FORMAT = "megazero-checkpoint-v2"  # per-rank data shards (megazero.checkpoint.shards)
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
CONFIG = "config.json"
EMBEDDING = "word_embeddings.weight"  # where a tied output head's weight is stored

# ModelConfig fields that fix the parameter set and shapes (compared on load)
ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "vocab_size", "max_position_embeddings", "position_embedding_type",
               "normalization", "activation", "add_bias_linear", "untie_embeddings_and_output_weights",
               "qk_layernorm", "qk_layernorm_scope", "norm_position", "softmax_type",
               "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim",
               # hybrid stacks and Gated DeltaNet (docs/hybrid.md)
               "hybrid_layer_pattern", "mamba_num_heads", "mamba_head_dim", "mamba_state_dim",
               "mamba_num_groups", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim",
               "linear_conv_kernel_dim", "attention_output_gate", "experimental_attention_variant",
               "linear_attention_freq")

# MoEConfig fields that fix the parameter set and shapes (compared on load, recorded with the model's)
MOE_ARCH_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                   "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                   "moe_router_enable_expert_bias", "moe_router_bias")

# OptimizerConfig fields of the learning-rate schedule (compared on load unless
# --override-opt-param-scheduler, as Megatron-LM does)
SCHEDULER_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_warmup_init",
                    "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_style",
                    "lr_wsd_decay_iters", "lr_wsd_decay_samples", "decoupled_lr", "decoupled_min_lr")

# ModelConfig fields --use-checkpoint-args takes from a checkpoint (Megatron-LM's list, in megazero's terms)
CHECKPOINT_ARGS = ARCH_FIELDS + MOE_ARCH_FIELDS + (
                                 "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                                 "moe_router_topk_scaling_factor", "moe_router_load_balancing_type",
                                 "moe_router_num_groups", "moe_router_group_topk",
                                 "moe_router_group_score_topk", "moe_apply_probs_on_input",
                                 "moe_aux_loss_coeff",
                                 "seq_length", "norm_epsilon", "rotary_base", "add_qkv_bias",
                                 "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                                 "rope_scaling_high_freq_factor",
                                 "rope_scaling_original_max_position_embeddings",
                                 "rotary_seq_len_interpolation_factor", "no_rope_freq",
                                 "rotary_scaling_factor",
                                 "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                                 "yarn_correction_range_round_to_int", "mscale", "mscale_all_dim",
                                 "dynamic_rope_scaling_factor", "window_size", "window_attn_skip_freq",
                                 "attn_logit_softcapping", "final_logit_softcapping", "softmax_scale",
                                 "scale_embedding", "hf_model_type", "hidden_dropout",
                                 "attention_dropout",
                                 # the attention and MLP variants of docs/attention.md
                                 "rotary_percent", "rotary_base_local", "attention_chunk_size", "qk_l2_norm",
                                 "qk_l2_norm_scope", "attn_temperature_tuning",
                                 "attn_temperature_floor_scale", "attn_temperature_scale",
                                 "glu_linear_offset", "activation_func_clamp_value",
                                 "rope_type",  # multi-latent attention's RoPE
                                 "mamba_chunk_size", "linear_chunk_size")  # the SSM scans' chunks
# DataConfig fields it takes too (as one group: none of them when any is given), unless
# --no-use-tokenizer-model-from-checkpoint-args
CHECKPOINT_TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")


def saved_settings(cfg) -> Dict[str, object]:
    """The configuration a checkpoint records (``config.json``): every setting, with the tokenizer's
    files as absolute paths, so that an export or a ``--use-checkpoint-args`` run started from another
    directory finds them."""
    out = cfg.to_dict()
    data = out.get("data", {})
    for k in ("tokenizer_model", "vocab_file", "merge_file"):
        if data.get(k) and os.path.exists(data[k]):
            data[k] = os.path.abspath(data[k])
    return out


def checkpoint_path(directory: str, iteration: int) -> str:
    """``DIR/iter_0000010``: the directory of one iteration's checkpoint."""
    return os.path.join(directory, f"iter_{iteration:07d}")


def rng_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"rng_tp{tp_rank:02d}_pp{pp_rank:03d}_dp{dp_rank:03d}.pt"


def layout_of(cfg, mesh) -> Dict[str, object]:
    """Everything that decides which rank holds what (RNG states are kept only when it matches).
    ``dp`` counts the optimizer shards (dp x cp: ZeRO shards over both, as Megatron-LM's distributed
    optimizer does); ``cp`` is recorded only when > 1, ``ep`` and ``etp`` only when the experts are
    split otherwise than over TP, so other layouts read as before."""
    par = cfg.parallel
    out = {"world_size": mesh.world_size, "tp": mesh.size("tp"), "pp": mesh.size("pp"),
           "dp": mesh.size("dp", "cp"),
           "zero_stage": par.zero_stage, "rank_order": mesh.order,
           "virtual_stage_layers": par.num_layers_per_virtual_pipeline_stage,
           "first_stage_layers": par.decoder_first_pipeline_num_layers,
           "last_stage_layers": par.decoder_last_pipeline_num_layers}
    if mesh.size("cp") > 1:
        out["cp"] = mesh.size("cp")
    if mesh.size("ep") > 1 or mesh.size("etp") != mesh.size("tp"):  # experts split otherwise than TP
        out.update(ep=mesh.size("ep"), etp=mesh.size("etp"))
    return out


def scheduler_of(cfg) -> Dict[str, object]:
    return {k: getattr(cfg.optimizer, k) for k in SCHEDULER_FIELDS}


def arch_of(cfg) -> Dict[str, object]:
    """The architecture fields (the model's, and the mixture of experts' when there is one)."""
    out = {k: getattr(cfg.model, k) for k in ARCH_FIELDS}
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.num_experts:
        out.update({k: getattr(moe, k) for k in MOE_ARCH_FIELDS})
        out["moe_layer_freq"] = str(moe.moe_layer_freq)  # a file may give an integer
    return out


def named_params(chunks) -> List[Tuple[str, torch.nn.Parameter]]:
    """This rank's parameters by global name, each once (chunks never share a name)."""
    seen, out = set(), []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def rng_trackers(chunks) -> list:
    """The distinct tensor-parallel RNG trackers the chunks use (``chunk.rng_tracker``)."""
    seen, out = set(), []
    for chunk in chunks:
        t = getattr(chunk, "rng_tracker", None)
        if t is not None and hasattr(t, "get_state") and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
