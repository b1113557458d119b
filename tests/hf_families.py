"""Tiny random transformers models of every architecture megazero imports (built from configs, nothing
downloaded), shared by tests/test_hf_models.py and the fine-tuning tests.  Sequences of SEQ tokens are
longer than every window here (WINDOW positions), so each window hides keys.  The mixtures of experts
have 8 experts, top-2: Mixtral (renormalised top-2, a window), Qwen2-MoE (weights not renormalised, a
gated shared expert, a dense first layer), Qwen3-MoE (renormalised, q/k norms) and OLMoE."""
import torch

VOCAB, SEQ, WINDOW = 96, 48, 12
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
             bos_token_id=0, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 50000.0}  # scaled within SEQ tokens
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
             "beta_slow": 1.0, "rope_theta": 10000.0}  # the ramp covers some of head_dim 16's 8 frequencies


def _llama_family(t, name):
    if name == "llama3-rope-scaling":
        return t.LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
    if name == "llama-linear-rope":
        linear = {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}
        return t.LlamaConfig(**SHAPE, rope_parameters=linear, tie_word_embeddings=True)
    if name == "llama-yarn":
        return t.LlamaConfig(**SHAPE, rope_parameters=dict(YARN_ROPE), head_dim=16, tie_word_embeddings=False)
    if name == "llama-dynamic":  # dynamic NTK acts beyond max_position_embeddings: 16 here
        dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        return t.LlamaConfig(**dict(SHAPE, max_position_embeddings=16), rope_parameters=dynamic,
                             tie_word_embeddings=False)
    if name == "qwen2":
        return t.Qwen2Config(**SHAPE, tie_word_embeddings=True, use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "qwen2-untied":
        return t.Qwen2Config(**SHAPE, tie_word_embeddings=False)
    if name == "qwen2-window":  # layers from max_window_layers on attend within the window
        return t.Qwen2Config(**SHAPE, tie_word_embeddings=False, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=1)
    if name == "mistral":  # v0.2 and later: no sliding window; head_dim given apart from hidden / heads
        return t.MistralConfig(**SHAPE, sliding_window=None, head_dim=16, tie_word_embeddings=False)
    if name == "mistral-window":
        return t.MistralConfig(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False)
    return None


def _newer_families(t, name):
    if name == "qwen3":  # head_dim 16 with hidden 32 / 4 heads: the Qwen3-0.6B pattern
        return t.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True)
    if name == "gemma":
        return t.GemmaConfig(**dict(SHAPE, num_key_value_heads=1), head_dim=16)
    if name == "gemma2":  # small caps, so that they bend these tiny models' scores and logits
        return t.Gemma2Config(**SHAPE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if name == "gemma3":  # windowed, full, windowed: two RoPE bases (the full layers' scaled), q/k norms
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
        return t.Gemma3TextConfig(**dict(SHAPE, num_hidden_layers=3), head_dim=16, query_pre_attn_scalar=24,
                                  sliding_window=WINDOW, rope_parameters=rope,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if name == "llama4":  # dense layers; the second without RoPE (temperature changing every 8 positions),
        # the first chunked by the window's length, with the L2 q/k norm
        return t.Llama4TextConfig(**dict(SHAPE, intermediate_size=16), intermediate_size_mlp=64, head_dim=16,
                                  moe_layers=[], no_rope_layer_interval=2, attention_chunk_size=WINDOW,
                                  floor_scale=8, attn_scale=0.5, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if name == "llama4-moe":  # 4 layers, MoE every second (moe_layers [1, 3]): 4 experts, top-1 sigmoid
        # on the expert's input, a shared expert; NoPE on the MoE layers, chunks on the others
        return t.Llama4TextConfig(**dict(SHAPE, num_hidden_layers=4, intermediate_size=16),
                                  intermediate_size_mlp=48, head_dim=16, num_local_experts=4,
                                  num_experts_per_tok=1, interleave_moe_layer_step=2,
                                  no_rope_layer_interval=2,
                                  attention_chunk_size=WINDOW, floor_scale=8, attn_scale=0.5,
                                  tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if name == "phi3":
        return t.Phi3Config(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False, resid_pdrop=0.0,
                            embd_pdrop=0.0)
    if name == "olmo2":
        return t.Olmo2Config(**SHAPE, tie_word_embeddings=False)
    if name == "smollm3":  # the second layer skips RoPE
        return t.SmolLM3Config(**SHAPE, no_rope_layer_interval=2, tie_word_embeddings=True)
    return _moe_families(t, name)


MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)


def _moe_families(t, name):
    if name == "mixtral":
        return t.MixtralConfig(**SHAPE, num_local_experts=8, **MOE, sliding_window=WINDOW,
                               tie_word_embeddings=False)
    if name == "qwen2-moe":  # norm_topk_prob False: softmax over all experts, top-2, not renormalised
        return t.Qwen2MoeConfig(**SHAPE, num_experts=8, **MOE, moe_intermediate_size=16,
                                shared_expert_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False)
    if name == "qwen3-moe":
        return t.Qwen3MoeConfig(**SHAPE, num_experts=8, **MOE, moe_intermediate_size=16, head_dim=16,
                                norm_topk_prob=True)
    if name == "olmoe":
        return t.OlmoeConfig(**dict(SHAPE, intermediate_size=16), num_experts=8, **MOE)
    if name == "gpt-oss":  # windows on alternate layers, YaRN, a clamp these small activations reach
        yarn = dict(YARN_ROPE, truncate=False)
        return t.GptOssConfig(**dict(SHAPE, intermediate_size=16), head_dim=16, num_local_experts=8, **MOE,
                              sliding_window=WINDOW, swiglu_limit=0.3, rope_parameters=yarn)
    if name == "glm4-moe":  # a dense first layer; 8 experts in 4 groups (top-2 groups), scaled, partial RoPE
        return t.Glm4MoeConfig(**dict(SHAPE, intermediate_size=48), n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
                               n_group=4, topk_group=2, routed_scaling_factor=2.5, use_qk_norm=True,
                               attention_bias=True, num_nextn_predict_layers=0, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5})
    if name == "deepseek-v3":  # MLA with both ranks and YaRN (mscale_all_dim scales the scores); a dense
        # first layer, 8 experts in 4 groups (top-2 groups), scaled
        yarn = dict(YARN_ROPE, mscale=1.0, mscale_all_dim=0.8)
        return t.DeepseekV3Config(**dict(SHAPE, intermediate_size=48, num_key_value_heads=4), q_lora_rank=16,
                                  kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                  n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5, num_nextn_predict_layers=0, rope_parameters=yarn,
                                  tie_word_embeddings=False)
    if name == "qwen3-next":  # Gated DeltaNet, then gated attention (RoPE on a quarter of each head, q/k
        # norms); 1 + weight norms; renormalised top-2 of 8 experts beside a gated shared expert
        return t.Qwen3NextConfig(**dict(SHAPE, intermediate_size=48), head_dim=16, num_experts=8, **MOE,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                                 tie_word_embeddings=False)
    raise KeyError(name)


def family_config(name):
    import transformers
    return _llama_family(transformers, name) or _newer_families(transformers, name)


FAMILIES = ["llama3-rope-scaling", "llama-linear-rope", "llama-yarn", "llama-dynamic", "qwen2",
            "qwen2-untied", "qwen2-window", "mistral", "mistral-window", "qwen3", "gemma", "gemma2", "gemma3",
            "llama4", "phi3", "olmo2", "smollm3", "mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "gpt-oss",
            "glm4-moe", "deepseek-v3", "qwen3-next"]
MOE_FAMILIES = ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe", "gpt-oss", "glm4-moe", "deepseek-v3",
                "qwen3-next"]
EXPORTED_AS = {"qwen2": "Qwen2", "qwen2-untied": "Qwen2", "qwen2-window": "Qwen2", "mistral": "Mistral",
               "mistral-window": "Mistral", "qwen3": "Qwen3", "gemma": "Gemma", "gemma2": "Gemma2",
               "gemma3": "Gemma3", "llama4": "Llama4", "llama4-moe": "Llama4",
               "phi3": "Phi3", "olmo2": "Olmo2", "smollm3": "SmolLM3", "mixtral": "Mixtral",
               "qwen2-moe": "Qwen2Moe", "qwen3-moe": "Qwen3Moe", "olmoe": "Olmoe",
               "gpt-oss": "GptOss", "glm4-moe": "Glm4Moe",
               "deepseek-v3": "DeepseekV3", "qwen3-next": "Qwen3Next"}  # the others: LLaMA


def hf_model(name, **over):
    """A tiny random model of family ``name`` (config fields changed by ``over``), every weight
    perturbed."""
    import transformers
    torch.manual_seed(0)
    config = family_config(name)
    for k, v in over.items():
        setattr(config, k, v)
    eager = dict(experts_implementation="eager") if name in MOE_FAMILIES else {}  # its loop runs float64 too
    return perturbed(transformers.AutoModelForCausalLM.from_config(config, **eager).eval())


def perturbed(model):
    """``model`` with every weight (and the MoE layers' expert bias) moved by N(0, 0.1^2) noise: norms
    start at ones and biases at zeros, so without it a mapping that mixes them up would go unseen."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for n, b in model.named_buffers():  # GLM-4.5's, DeepSeek-V3's and Nemotron-H's expert bias
            if n.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model


def assert_refused(config, over, needle):
    """Importing transformers' ``config`` with the fields ``over`` set raises megazero's one-line
    ConfigError that names the field: 'unsupported Hugging Face config: <needle>' (a regex)."""
    import pytest
    from megazero.config import ConfigError
    from models.hf import config_from_hf
    for k, v in over.items():
        setattr(config, k, v)
    with pytest.raises(ConfigError, match=f"unsupported Hugging Face config: {needle}"):
        config_from_hf(config)


def assert_greedy_equals_transformers(hf, model, prompt, new_tokens=24, **hf_generate):
    """megazero's greedy ``generate`` from ``prompt`` (its caches) gives transformers' tokens exactly."""
    from models.generate import generate
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           eos_token_id=None, **hf_generate)
    assert torch.equal(generate(model, prompt, max_new_tokens=new_tokens), want)
