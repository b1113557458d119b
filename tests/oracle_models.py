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
}
MOE = [f for f in FAMILIES if FAMILIES[f].get("num_experts")]
DENSE = [f for f in FAMILIES if f not in MOE]
# families outside the golden values (tests/golden.json pins FAMILIES), checked by their own tests
EXTRA_FAMILIES = {
    # multi-latent attention (DeepSeek-V3): both latents, value heads narrower than query heads, YaRN
    "mla": dict(LLAMA, num_query_groups=None, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8,
                qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True,
                rotary_scaling_factor=4.0, mscale=0.707, mscale_all_dim=0.707,
                yarn_original_max_position_embeddings=8),
}


def family_cfg(family: str, **layout):
    """The family's configuration (not validated) with ``layout`` (any config field by name)."""
    return config_from_dict(dict(BASE, **{**FAMILIES, **EXTRA_FAMILIES}[family], **layout))
