"""The model families the oracle tests pin (tests/test_init_equality.py, tests/test_golden.py): one
small configuration per family the project builds, six layers each so that every pipeline layout of
the tests (PP 2, uneven PP 4 as 1|2|2|1, virtual stages) cuts it.  Dropout off: the oracle runs
compare layouts."""
from megazero.config import config_from_dict

BASE = dict(mock_data=True, num_layers=6, hidden_size=32, num_attention_heads=4, seq_length=16,
            vocab_size=100, make_vocab_size_divisible_by=8, global_batch_size=8, micro_batch_size=1,
            train_iters=2, lr_decay_iters=4, optimizer="sgd", lr=0.1, sgd_momentum=0.0, log_interval=100,
            hidden_dropout=0.0, attention_dropout=0.0, seed=21)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             add_bias_linear=False, num_query_groups=2, ffn_hidden_size=48,
             untie_embeddings_and_output_weights=True)
# multi-latent attention (DeepSeek-V3): both latents, value heads narrower than query heads, YaRN
MLA = dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8,
           qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True, rotary_scaling_factor=4.0,
           mscale=0.707, mscale_all_dim=0.707, yarn_original_max_position_embeddings=8)
FAMILIES = {
    "gpt2": dict(),  # learned positions, LayerNorm, GELU, biases, tied head
    "gpt2-untied": dict(untie_embeddings_and_output_weights=True),
    "llama": LLAMA,  # RoPE, RMSNorm, SwiGLU, GQA, untied head
    # per-head q/k norms, windows, a layer without RoPE
    "qwen3": dict(LLAMA, qk_layernorm=True, window_size=[5, 0], no_rope_freq=3),
    "olmo2": dict(LLAMA, qk_layernorm=True, qk_layernorm_scope="all", norm_position="post"),
    "gemma2": dict(LLAMA, activation="geglu", norm_position="sandwich", scale_embedding=True, kv_channels=8,
                   window_size=[5, 0], window_attn_skip_freq=2,
                   untie_embeddings_and_output_weights=False),  # Gemma 2 norms, tied head
    "moe": dict(LLAMA, num_experts=4, moe_router_topk=2, moe_layer_freq="([0]*1+[1]*1)*3",
                moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                moe_token_dispatcher_type="alltoall"),
    # Llama 4's MoE layers: top-1 sigmoid routing weighing the expert's input, an ungated shared expert;
    # layers without RoPE and the L2 q/k norm on the others
    "llama4-moe": dict(LLAMA, num_experts=4, moe_router_topk=1, moe_layer_freq="([0]*1+[1]*1)*3",
                       moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=24,
                       moe_router_score_function="sigmoid", moe_apply_probs_on_input=True,
                       moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall",
                       no_rope_freq=2, qk_l2_norm=True, qk_l2_norm_scope="rope"),
    # Nemotron-H-like hybrid: Mamba-2 (4 heads in 2 groups: TP 2 splits whole groups), attention, MLP
    # and MoE layers; squared ReLU, no position embedding
    "mamba-hybrid": dict(LLAMA, hybrid_layer_pattern="M*M-E-", mamba_num_heads=4, mamba_head_dim=8,
                         mamba_num_groups=2, mamba_state_dim=8, mamba_chunk_size=8, activation="squared_relu",
                         position_embedding_type="none", num_experts=4, moe_router_topk=2,
                         moe_ffn_hidden_size=24, moe_token_dispatcher_type="alltoall"),
    # Qwen3-Next: Gated DeltaNet beside every third layer's gated attention (q/k norms, RoPE on a quarter
    # of each head); renormalised top-2 MoE with a gated shared expert on every layer.  Its 1 + weight
    # norms are the same model (megazero stores the scale itself; --apply-layernorm-1p is a no-op)
    "qwen3-next": dict(LLAMA, experimental_attention_variant="gated_delta_net", linear_attention_freq=3,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_chunk_size=8, attention_output_gate=True,
                       qk_layernorm=True, kv_channels=8, rotary_percent=0.25, num_experts=4,
                       moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                       moe_shared_expert_gate=True, moe_token_dispatcher_type="alltoall"),
    # DeepSeek-V3: multi-latent attention (MLA), a dense first layer, sigmoid routing within the best
    # of 2 groups, scaled, an expert bias, a shared expert, and one multi-token-prediction depth (its
    # loss pinned too)
    "deepseek-v3": dict(MLA, num_experts=4, moe_router_topk=2, moe_layer_freq="[0]*1+[1]*5",
                        moe_ffn_hidden_size=16,
                        moe_shared_expert_intermediate_size=16, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
                        moe_router_topk_scaling_factor=2.5, moe_token_dispatcher_type="alltoall",
                        mtp_num_layers=1),
    # gpt-oss: attention sinks, the clamped SwiGLU (clamped at 0.05: it acts on these small activations),
    # biases, windows on alternate layers, MoE on every layer with a router bias
    "gpt-oss": dict(LLAMA, add_bias_linear=True, softmax_type="learnable", activation="quick_geglu",
                    glu_linear_offset=1.0, activation_func_clamp_value=0.05, kv_channels=8,
                    window_size=[4, 0], window_attn_skip_freq=2, num_experts=4, moe_router_topk=2,
                    moe_ffn_hidden_size=16, moe_router_bias=True, moe_token_dispatcher_type="alltoall",
                    expert_tensor_parallel_size=1),  # biased experts: Megatron-LM's rule
    # Gemma 3: Gemma 2's norms and tied head, q/k norms, 5 windowed layers to 1 full, the windowed
    # layers' local RoPE base beside the full layers' (linearly scaled) global one
    "gemma3": dict(LLAMA, activation="geglu", norm_position="sandwich", scale_embedding=True, kv_channels=8,
                   qk_layernorm=True, window_size=[4, 0], window_attn_skip_freq=6, rotary_base_local=100.0,
                   rotary_seq_len_interpolation_factor=2.0, untie_embeddings_and_output_weights=False),
}
MOE = [f for f in FAMILIES if FAMILIES[f].get("num_experts")]
DENSE = [f for f in FAMILIES if f not in MOE]
# families outside the golden values (tests/golden.json pins FAMILIES), checked by their own tests
EXTRA_FAMILIES = {
    "mla": MLA,  # dense MLA (tests/test_mla.py); deepseek-v3 above pins it with its MoE and MTP
}


def family_cfg(family: str, **layout):
    """The family's configuration (not validated) with ``layout`` (any config field by name, over the
    family's own)."""
    return config_from_dict(dict(BASE, **{**{**FAMILIES, **EXTRA_FAMILIES}[family], **layout}))


def nudge_init(monkeypatch, layer: int, factor: float):
    """Scale every random initial value of global layer ``layer`` by ``factor``: the normal draws
    (``init_full``, in each module that holds it) and the uniform ones of the recurrent mixers (Mamba-2's
    and Gated DeltaNet's convolutions, decays and time steps)."""
    import importlib

    import megazero.tensor_parallel.layers as layers
    import models.ssm_common as ssm
    full, uniform = layers.init_full, ssm.uniform_init

    def nudged_full(shape, seed, layer_idx, name, std, *args, **kwargs):
        out = full(shape, seed, layer_idx, name, std, *args, **kwargs)
        return out * factor if layer_idx == layer else out

    def nudged_uniform(seed, layer_idx, name, low, high):
        draw = uniform(seed, layer_idx, name, low, high)
        return (lambda shape: draw(shape) * factor) if layer_idx == layer else draw
    for module in ("megazero.tensor_parallel.layers", "megazero.moe.experts", "megazero.moe.router",
                   "models.gpt", "models.moe", "models.mtp"):
        monkeypatch.setattr(importlib.import_module(module), "init_full", nudged_full)
    monkeypatch.setattr(ssm, "uniform_init", nudged_uniform)
