"""The Hugging Face models people fine-tune, against transformers (tiny random models, tests/hf_families.py,
nothing downloaded): LLaMA with rope_scaling (llama3, linear, yarn, dynamic), Qwen2 (QKV bias, sliding
window on some layers), Mistral (with and without its window), Qwen3 (q/k norms, head_dim apart from
hidden / heads), Gemma (1 + weight norms, embedding scale, GeGLU), Gemma 2 (sandwich norms, soft-caps,
alternating windows, query_pre_attn_scalar), Phi-3 (fused weights, window), OLMo 2 (norms after the
sublayers, q/k norms over all heads), SmolLM3 (a layer without RoPE) and the mixtures of experts Mixtral,
Qwen2-MoE (shared expert and its gate, a dense layer), Qwen3-MoE and OLMoE (their routing: renormalised
top-k weights or not; logits within 1e-5 of transformers'), and (hf_families.py) Gemma 3, Llama 4, gpt-oss,
GLM-4.5 (partial RoPE, grouped sigmoid routing with expert bias) and DeepSeek-V3 (multi-latent
attention).  Sequences are longer than every window.
Import: logits and greedy generation (KV cache) equal transformers'; what each family
adds changes the logits measurably; export: transformers loads the same model back, as the same
architecture; TP 2 equals transformers.  What megazero cannot represent is refused, naming the feature."""
import pytest
import torch

from megazero.config import ConfigError
from megazero.process.local_ranks import run_ranks
from megazero.mesh import ParallelMesh
from models.hf import config_from_hf, from_hf, to_hf
from hf_families import (EXPORTED_AS, FAMILIES, MOE_FAMILIES, SEQ, VOCAB, assert_greedy_equals_transformers,
                         assert_refused, family_config, hf_model)
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))

# settings that take away what a family adds: the model without it is measurably another one
WITHOUT = {"llama3-rope-scaling": dict(use_rope_scaling=False),
           "llama-linear-rope": dict(rotary_seq_len_interpolation_factor=None),
           "llama-yarn": dict(position_embedding_type="rope"),
           "llama-dynamic": dict(dynamic_rope_scaling_factor=None),
           "qwen2-window": dict(window_size=None, window_attn_skip_freq=None),
           "mistral-window": dict(window_size=None),
           "gemma": dict(scale_embedding=False),
           "gemma2": dict(attn_logit_softcapping=None),
           "phi3": dict(window_size=None),
           "smollm3": dict(no_rope_freq=None),
           "mixtral": dict(moe_router_pre_softmax=True),  # top-2 weights not renormalised
           "qwen2-moe": dict(moe_router_pre_softmax=False),  # renormalised
           "qwen3-moe": dict(moe_router_pre_softmax=True),
           "olmoe": dict(moe_router_pre_softmax=False)}
MORE_WITHOUT = {"gemma2": [dict(final_logit_softcapping=None),
                           dict(window_size=None, window_attn_skip_freq=None), dict(softmax_scale=None)],
                "gemma": [dict(activation="swiglu")],
                "gemma3": [dict(rotary_base_local=None), dict(qk_layernorm=False)],
                "llama4": [dict(attention_chunk_size=None), dict(qk_l2_norm=False),
                           dict(attn_temperature_tuning=False)],
                "gpt-oss": [dict(softmax_type="off-by-one"), dict(activation_func_clamp_value=None),
                            dict(glu_linear_offset=0.0)],
                "mixtral": [dict(window_size=None)],
                "glm4-moe": [dict(rotary_percent=1.0), dict(qk_layernorm=False), dict(add_qkv_bias=False),
                             dict(moe_router_enable_expert_bias=False),
                             dict(moe_router_topk_scaling_factor=None),
                             dict(moe_router_num_groups=None, moe_router_group_topk=None,
                                  moe_router_group_score_topk=None),
                             dict(moe_router_group_score_topk=1)],
                "qwen2-moe": [dict(moe_shared_expert_gate=False), dict(moe_router_topk=1)],
                "deepseek-v3": [dict(rope_type="rope"), dict(mscale_all_dim=0.0), dict(qk_layernorm=False),
                                dict(moe_router_enable_expert_bias=False),
                                dict(moe_router_topk_scaling_factor=None),
                                dict(moe_router_num_groups=None, moe_router_group_topk=None,
                                     moe_router_group_score_topk=None)]}


def close_to_hf(got, ref):
    """Another implementation of the same fp32 forward: the scaled fp32 bound C_FWD * U32 * max|ref|
    (tolerance.py), as tests/test_hf.py."""
    torch.testing.assert_close(got, ref, **fp32_bound(ref, C_FWD))


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


BEFORE = ("llama3-rope-scaling", "llama-linear-rope", "qwen2", "qwen2-untied", "mistral")  # the fast tier's
PARAMS = [f if f in BEFORE else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]


@pytest.fixture(scope="module", params=PARAMS)
def family(request):
    return request.param, hf_model(request.param)


def test_import_matches_transformers_logits(family):
    name, hf = family
    model = from_hf(hf).eval()
    ref = _logits(hf)
    close_to_hf(_logits(model), ref)
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-5)  # the bound too
    m = model.cfg.model
    if name.startswith("qwen2"):
        assert m.add_qkv_bias and not m.add_bias_linear
    if name == "llama3-rope-scaling":
        assert m.use_rope_scaling and m.rope_scaling_factor == 4.0
        assert m.rope_scaling_original_max_position_embeddings == 16
    if name == "gemma2":
        assert m.window_size == [11, 0] and m.window_attn_skip_freq == 2 and m.norm_position == "sandwich"
    if name in MOE_FAMILIES:
        moe = model.cfg.moe
        assert (moe.num_experts, moe.moe_router_topk, moe.moe_expert_capacity_factor) == (8, 2, None)
    if name == "qwen2-moe":
        assert moe.moe_layer_freq == "[0,1]" and moe.moe_shared_expert_intermediate_size == 48
    for plain in ([WITHOUT[name]] if name in WITHOUT else []) + MORE_WITHOUT.get(name, []):
        other = from_hf(hf, cfg_overrides=plain).eval()
        assert (_logits(other) - ref).abs().max() > 100 * fp32_bound(ref, C_FWD)["atol"], plain


def test_greedy_generation_equals_transformers(family):
    """Prompt 8 + 24 new tokens: past every window, so the cached path masks old keys too."""
    name, hf = family
    model = from_hf(hf).eval()
    assert_greedy_equals_transformers(hf, model, IDS[:, :8])


def test_export_loads_back_in_transformers(family, tmp_path):
    name, hf = family
    model = from_hf(hf).eval()
    to_hf(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(back).__name__ == EXPORTED_AS.get(name, "Llama") + "ForCausalLM"
    close_to_hf(_logits(back), _logits(hf))
    again = config_from_hf(back.config)  # the exported config imports as the same megazero model
    assert again == config_from_hf(hf.config)


# biases, q/k norms (head, all), partial RoPE and experts under SP (GLM-4.5), MLA's split heads (DeepSeek-V3)
TP_FAMILIES = ["qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "glm4-moe", "deepseek-v3"]


def _tp2_logits(paths):
    mesh = ParallelMesh.build(tp=2)
    return {name: _logits(from_hf(path, mesh).eval()) for name, path in paths.items()}


@pytest.mark.slow
def test_tensor_parallel_import_matches_transformers(tmp_path):
    """TP 2 splits heads (and OLMo 2's all-head q/k norm, whose sum of squares is all-reduced)."""
    models = {name: hf_model(name) for name in TP_FAMILIES}
    paths = {}
    for name, hf in models.items():
        paths[name] = str(tmp_path / name)
        hf.save_pretrained(paths[name])
    for got in run_ranks(_tp2_logits, 2, paths):
        for name, hf in models.items():
            close_to_hf(got[name], _logits(hf))


@pytest.mark.parametrize("name,over,needle", [
    ("qwen2", dict(layer_types=["sliding_attention", "chunked_attention"], sliding_window=16,
                   use_sliding_window=True),
     "layer_types=\\['chunked_attention'\\]; only sliding_attention and full_attention"),
    ("llama3-rope-scaling", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                  "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
     "rope_scaling=.*'longrope'.*is not implemented"),
    ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5; partial rotary embeddings"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True; linear biases on all attention projections"),
    ("gemma2", dict(use_bidirectional_attention=True),
     "use_bidirectional_attention=True; attention is causal"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1; jitter on the router's input"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0; clamping the queries"),
    ("qwen2-moe", dict(mlp_only_layers=[0, 1]), "num_experts=8; a qwen2_moe config without MoE layers"),
    ("glm4-moe", dict(norm_topk_prob=False), "norm_topk_prob=False; megazero normalises the chosen sigmoid"),
    ("glm4-moe", dict(n_group=3), "n_group=3; groups of at least 2 experts dividing"),
    ("deepseek-v3", dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05; transformers' DeepSeek-V3 normalises"),
    ("deepseek-v3", dict(attention_bias=True), "attention_bias=True; linear biases"),
    ("deepseek-v3", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "quantization_config.quant_method='fp8'; quantised weights are not read"),
])
def test_what_megazero_cannot_represent_is_refused_by_name(name, over, needle):
    assert_refused(family_config(name), over, needle)


@pytest.mark.parametrize("kind,feature", [("olmo", "non-parametric layer norm"),
                                          ("llama4", "vision tower"),
                                          ("gemma3", "vision tower")])
def test_a_refused_architecture_names_the_missing_feature(kind, feature):
    cfg = transformers.AutoConfig.for_model(kind)
    with pytest.raises(ConfigError, match=f"model_type='{kind}' needs .*{feature}"):
        config_from_hf(cfg)


def test_a_window_longer_than_the_sequence_changes_nothing():
    hf = hf_model("mistral")
    wide = from_hf(hf, cfg_overrides=dict(window_size=[SEQ - 1, 0])).eval()
    assert torch.equal(_logits(wide), _logits(from_hf(hf).eval()))


@pytest.mark.parametrize("hf_type,needle", [("gemma", "activation swiglu \\(gemma has geglu\\)"),
                                            ("qwen3", "--qk-layernorm off \\(qwen3: head\\)")])
def test_export_as_an_architecture_that_cannot_hold_the_model_is_refused(hf_type, needle, tmp_path):
    model = from_hf(hf_model("mistral-window"), cfg_overrides=dict(hf_model_type=hf_type))
    with pytest.raises(ConfigError, match=f"--hf-model-type {hf_type} cannot hold this model: {needle}"):
        to_hf(model, str(tmp_path))


@pytest.mark.parametrize("family,over,hf_type,needle", [
    ("mistral-window", {}, "mixtral", "mixture-of-experts layers \\(mixtral has them\\)"),
    ("mixtral", {}, "qwen2", "mixture-of-experts layers \\(qwen2 has none\\)"),
    ("mixtral", {}, "qwen2_moe", "no gated shared expert"),
    ("mixtral", dict(moe_router_pre_softmax=True), "mixtral", "--moe-router-pre-softmax \\(Mixtral renorm"),
    ("mixtral", dict(moe_router_score_function="sigmoid"), "mixtral",
     "--moe-router-score-function sigmoid \\(mixtral: softmax\\)"),
    ("qwen2-moe", {}, "qwen3_moe", "--qk-layernorm off"),
    ("qwen3-moe", {}, "glm4_moe", "--moe-router-score-function softmax \\(glm4_moe: sigmoid\\)"),
    ("glm4-moe", dict(moe_router_group_score_topk=1), "glm4_moe",
     "a group's score of other than its 2 best experts"),
    ("glm4-moe", {}, "qwen3_moe", "--rotary-percent 0.5 \\(qwen3_moe has no such part"),
    ("deepseek-v3", {}, "glm4_moe", "multi-latent attention, --multi-latent-attention \\(glm4_moe has none"),
    ("glm4-moe", dict(rotary_percent=1.0, add_qkv_bias=False), "deepseek_v3",
     "deepseek_v3 needs --multi-latent-attention"),
])
def test_moe_export_to_an_architecture_lacking_a_feature_is_refused(family, over, hf_type, needle, tmp_path):
    model = from_hf(hf_model(family), cfg_overrides=dict(over, hf_model_type=hf_type))
    with pytest.raises(ConfigError, match=f"--hf-model-type {hf_type} cannot hold this model: {needle}"):
        to_hf(model, str(tmp_path))


def test_moe_export_with_dense_layers_as_mixtral_is_refused(tmp_path):
    """Qwen2-MoE without its QKV bias, renormalised: Mixtral holds all but its dense first layer."""
    hf = hf_model("qwen2-moe", qkv_bias=False, norm_topk_prob=True)
    model = from_hf(hf, cfg_overrides=dict(hf_model_type="mixtral"))
    with pytest.raises(ConfigError, match="cannot hold this model: dense layers among the MoE layers, "
                                          "--moe-layer-freq \\[0,1\\] \\(mixtral: every layer MoE\\)"):
        to_hf(model, str(tmp_path))
