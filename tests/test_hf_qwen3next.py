"""Qwen3-Next (``Qwen3NextForCausalLM``) to megazero and back, against transformers' PyTorch paths (tiny
random models built here from configs, nothing downloaded): Gated DeltaNet layers in the attention
place (``--experimental-attention-variant gated_delta_net``), gated attention with per-head zero-centred
q/k norms and RoPE on half of each head, zero-centred layer norms, and a mixture of experts with a gated
shared expert beside a dense layer (``mlp_only_layers``), or a dense model with attention on a layer
list that no ``--linear-attention-freq N`` gives and one value head per key head.  Sequences of 50
tokens: not a multiple of either chunk of the delta rule used (64, transformers' too, and 16).

Import: logits within 1e-5 of transformers' (fp32), greedy decoding equal to ``generate``'s; what the
mapping carries (the partial RoPE, the renormalised top-k) changes the logits measurably.  Export:
``convert_hf.py``'s path (:mod:`models.hf_convert`) gives back transformers' own files tensor for tensor
(equal, the ``1 + weight`` norms to one rounding).  Refusals name the field or the flag.  Slow tier: a
3-step fine-tune under TP 2 (sequence parallel) equals one process step by step, its first loss is
transformers', and its checkpoint exports to a model transformers loads with megazero's logits."""

import pytest
import torch

from megazero.config import ConfigError
from models.hf import config_from_hf, from_hf, to_hf
from hf_families import assert_greedy_equals_transformers, perturbed
from hf_finetune_runs import (GBS, SEED, assert_layouts_agree, convert, converted_back, finetune_settings,
                              safetensors_of, train_one)
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 96, 50
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
KINDS = ["moe", "dense"]


def qwen3next_config(kind="moe", **over):
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
                  rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, tie_word_embeddings=False, bos_token_id=0, eos_token_id=None,
                  pad_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5})
    if kind == "moe":  # layer types by default: attention in every 4th layer
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=True,
                      router_aux_loss_coef=0.02)
    else:
        fields.update(num_experts=0, linear_num_value_heads=2, tie_word_embeddings=True,
                      layer_types=["linear_attention", "full_attention", "full_attention",
                                   "linear_attention"])
    fields.update(over)
    return transformers.Qwen3NextConfig(**fields)


def qwen3next_model(kind="moe", **over):
    """A tiny random Qwen3-Next, every weight perturbed (zero-centred norms start at zero)."""
    torch.manual_seed(0)
    return perturbed(transformers.AutoModelForCausalLM.from_config(qwen3next_config(kind, **over),
                                                                   experts_implementation="eager").eval())


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def close_to_hf(got, ref, absolute=True):
    """Two fp32 implementations of the same forward: the scaled fp32 bound C_FWD * U32 * max|ref|
    (tolerance.py) and, with ``absolute``, the issue's 1e-5.  transformers' own fp32 forward is ~1.5e-5 from
    its float64 one here (its delta rule always runs in fp32), so 1e-5 between the two is not a bound the
    math gives for every set of weights: it is asserted on the imported models (observed 6.9e-6)."""
    torch.testing.assert_close(got, ref, **fp32_bound(ref, C_FWD))
    if absolute:
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.fixture(scope="module", params=KINDS)
def family(request):
    return request.param, qwen3next_model(request.param)


def test_config_maps_every_field(family):
    kind, hf = family
    s = config_from_hf(hf.config)
    assert (s["experimental_attention_variant"], s["attention_output_gate"], s["rotary_percent"]) == \
        ("gated_delta_net", True, 0.5)
    assert (s["qk_layernorm"], s["qk_layernorm_scope"], s["kv_channels"], s["num_query_groups"]) == \
        (True, "head", 16, 2)
    if kind == "moe":
        assert s["linear_attention_freq"] == 4 and s["moe_layer_freq"] == "[1,0,1,1]"
        assert (s["num_experts"], s["moe_router_topk"], s["moe_ffn_hidden_size"]) == (4, 2, 16)
        assert (s["moe_shared_expert_intermediate_size"], s["moe_shared_expert_gate"]) == (24, True)
        assert not s["moe_router_pre_softmax"] and s["untie_embeddings_and_output_weights"]
    else:
        assert s["linear_attention_freq"] == [1, 0, 0, 1] and "num_experts" not in s
        assert (s["linear_num_key_heads"], s["linear_num_value_heads"]) == (2, 2)
        assert not s["untie_embeddings_and_output_weights"]


@pytest.mark.parametrize("chunk", [64, 16])
def test_import_matches_transformers_logits(family, chunk):
    kind, hf = family
    model = from_hf(hf, cfg_overrides=dict(linear_chunk_size=chunk)).eval()
    ref = _logits(hf)
    close_to_hf(_logits(model), ref)
    if chunk != 64:
        return
    changes = [dict(rotary_percent=1.0)] + ([dict(moe_router_pre_softmax=True)] if kind == "moe" else [])
    for other in changes:  # what the mapping carries matters
        moved = (_logits(from_hf(hf, cfg_overrides=other).eval()) - ref).abs().max()
        assert moved > 100 * fp32_bound(ref, C_FWD)["atol"], other


def test_greedy_generation_equals_transformers(family):
    """Prompt 8 + 24 new tokens, through the conv and recurrent states and the KV cache."""
    kind, hf = family
    model = from_hf(hf).eval()
    assert_greedy_equals_transformers(hf, model, IDS[:, :8])


def _zero_centred(name):
    return name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) \
        or name == "model.norm.weight"


def test_conversion_is_tensor_for_tensor(family, tmp_path):
    """transformers' files -> a megazero checkpoint -> transformers' files: the same names, the same
    tensors (the ``1 + weight`` norms to one fp32 rounding of ``1 + w``), which load as the same model."""
    kind, hf = family
    want, got = converted_back(hf, tmp_path)
    assert sorted(got) == sorted(want)
    assert any("linear_attn.conv1d" in n for n in want) and any("self_attn.q_proj" in n for n in want)
    for name, t in want.items():
        if _zero_centred(name):
            torch.testing.assert_close(got[name], t, rtol=0, atol=2.0 ** -23, msg=name)
        else:
            assert torch.equal(got[name], t), name
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    back.eval()
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    close_to_hf(_logits(back), _logits(hf))
    assert config_from_hf(back.config) == config_from_hf(hf.config)


def test_published_multi_token_prediction_tensors_are_named(tmp_path):
    """Qwen3-Next's published files carry its multi-token prediction layers (``mtp.*``), which transformers
    and megazero do not build: refused by name, dropped with ``allow_unused_weights``."""
    from safetensors.torch import save_file
    from models.hf_convert import to_megazero
    qwen3next_model("dense").save_pretrained(str(tmp_path / "hf"))
    tensors = safetensors_of(str(tmp_path / "hf"))
    tensors["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    needle = "tensor 'mtp.fc.weight' \\(the one unused tensor\\) belongs to Qwen3-Next's multi-token " \
        "prediction layers.*--allow-unused-weights"
    with pytest.raises(ConfigError, match=needle):
        to_megazero(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    notes = []
    to_megazero(str(tmp_path / "hf"), str(tmp_path / "ckpt"), allow_unused_weights=True, notes=notes)
    assert notes == ["dropped 1 unused tensor (the first: mtp.fc.weight)"]


@pytest.mark.parametrize("over", [{}, dict(hf_model_type=None, rotary_percent=1.0)])
def test_in_memory_export_loads_back(over, tmp_path):
    """``models.hf.to_hf``; also of a model no import named (``--hf-model-type`` unset: Gated DeltaNet in
    transformer layers picks qwen3_next) with RoPE on whole heads (transformers' default is a quarter)."""
    model = from_hf(qwen3next_model("moe"), cfg_overrides=over).eval()
    to_hf(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert back.config.rope_parameters["partial_rotary_factor"] == model.cfg.model.rotary_percent
    close_to_hf(_logits(model), _logits(back))


@pytest.mark.parametrize("over,needle", [
    (dict(attention_bias=True), "attention_bias=True; linear biases"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'; megazero's Qwen3-Next has SwiGLU"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "layer_types=\\['sliding_attention'\\]; only linear_attention"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                           "partial_rotary_factor": 0.5}),
     "rope_parameters.rope_type='linear'; megazero's Qwen3-Next has plain RoPE"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0; Qwen3-Next's MoE layers"),
])
def test_what_megazero_cannot_represent_is_refused_by_name(over, needle):
    with pytest.raises(ConfigError, match=f"unsupported Hugging Face config: {needle}"):
        config_from_hf(qwen3next_config("moe", **over))


@pytest.mark.parametrize("over,needle", [
    (dict(qk_layernorm=False), "--hf-model-type qwen3_next cannot hold this model: qwen3_next needs "
                               "--qk-layernorm per head"),
    (dict(attention_output_gate=False), "qwen3_next needs --attention-output-gate"),
    (dict(moe_shared_expert_gate=False), "no gated shared expert \\(qwen3_next has one"),
    (dict(hf_model_type="qwen3_moe"),
     "--hf-model-type qwen3_moe cannot hold this model: Gated DeltaNet layers"),
    (dict(hf_model_type=None, qk_layernorm=False), "no transformers architecture holds this model "
                                                   "\\(qwen3_next: qwen3_next needs --qk-layernorm"),
])
def test_export_of_what_qwen3next_cannot_hold_is_refused(over, needle, tmp_path):
    model = from_hf(qwen3next_model("moe"), cfg_overrides=over)
    with pytest.raises(ConfigError, match=needle):
        to_hf(model, str(tmp_path))


def _tp2_logits(path):
    from megazero.mesh import ParallelMesh
    return _logits(from_hf(path, ParallelMesh.build(tp=2), dict(linear_chunk_size=16)).eval())


@pytest.mark.slow
def test_tensor_parallel_import_matches_transformers(tmp_path):
    """``from_hf`` under TP 2 (sequence parallel for the experts): each rank holds one key head of the
    Gated DeltaNet with its value heads, one query group and its gate rows; the logits are transformers'."""
    from megazero.process.local_ranks import run_ranks
    hf = qwen3next_model("moe")
    hf.save_pretrained(str(tmp_path))
    for got in run_ranks(_tp2_logits, 2, str(tmp_path)):
        close_to_hf(got, _logits(hf))


# ---- fine-tuning under TP 2 (slow) ----------------------------------------------------------------
TRAIN_SEQ = 40


def _settings(ckpt, save=None, tp=1):
    return finetune_settings(ckpt, TRAIN_SEQ, save, lr=0.01, tp=tp, sequence_parallel=tp > 1,
                             linear_chunk_size=16)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    from megazero.process.local_ranks import run_ranks
    d = tmp_path_factory.mktemp("qwen3next_finetune")
    hf = qwen3next_model("moe", output_router_logits=True)
    ckpt = convert(hf, d)
    one = train_one(_settings(ckpt))
    two = run_ranks(train_one, 2, _settings(ckpt, str(d / "run"), tp=2), timeout=600)
    return d, hf, one, two


@pytest.mark.slow
def test_tp2_finetune_equals_one_process(finetuned):
    _, _, one, two = finetuned
    assert_layouts_agree(one, two, ("loss", "grad_norm", "moe_aux_loss"))
    assert one[0]["moe_aux_loss"] > 0


@pytest.mark.slow
def test_first_finetune_loss_is_the_transformers_loss(finetuned):
    from megazero.data.mock import MockGPTData
    _, hf, one, _ = finetuned
    tokens = MockGPTData(VOCAB, TRAIN_SEQ, seed=SEED).get_tokens(list(range(GBS)), "train")  # the first batch
    logits = _logits(hf, tokens[:, :-1])
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert one[0]["loss"] == pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_the_tp2_checkpoint_exports_to_transformers(finetuned):
    from models.checkpoint import load_model
    from models.hf_convert import to_hf as convert_to_hf
    d, hf, _, _ = finetuned
    convert_to_hf(str(d / "run"), str(d / "exported"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(d / "exported"), dtype=torch.float32,
                                                             experts_implementation="eager").eval()
    assert type(back).__name__ == "Qwen3NextForCausalLM"
    model, info = load_model(str(d / "run"))
    assert info["iteration"] == 3
    ref = _logits(back)
    close_to_hf(_logits(model.eval()), ref, absolute=False)  # observed 5.6e-6, max |logit| 2.3
    assert (ref - _logits(hf)).abs().max() > 1e-4  # the exported weights are the fine-tuned ones
