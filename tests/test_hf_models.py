"""The Hugging Face models people fine-tune, against transformers (tiny random models built here, no
download): LLaMA-3.x with rope_scaling (llama3 and linear), Qwen2 (QKV bias), Mistral without a
sliding window (a LLaMA). Import: logits and greedy generation equal transformers'; export: transformers
loads the same model back. What megazero cannot represent is refused by name."""
import pytest
import torch

from megazero.config import ConfigError
from megazero.mesh import ParallelMesh
from megazero.local_ranks import run_ranks
from models.generate import generate
from models.hf import config_from_hf, from_hf, to_hf
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")
VOCAB, SEQ = 96, 48
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
             bos_token_id=0, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 50000.0}  # scaled within SEQ tokens


def family_config(name):
    t = transformers
    if name == "llama3-rope-scaling":
        return t.LlamaConfig(**SHAPE, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False)
    if name == "llama-linear-rope":
        linear = {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0}
        return t.LlamaConfig(**SHAPE, rope_parameters=linear, tie_word_embeddings=True)
    if name == "qwen2":
        return t.Qwen2Config(**SHAPE, tie_word_embeddings=True, use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "qwen2-untied":
        return t.Qwen2Config(**SHAPE, tie_word_embeddings=False)
    if name == "mistral":  # v0.2 and later: no sliding window; head_dim given apart from hidden / heads
        return t.MistralConfig(**SHAPE, sliding_window=None, head_dim=16, tie_word_embeddings=False)
    raise KeyError(name)


FAMILIES = ["llama3-rope-scaling", "llama-linear-rope", "qwen2", "qwen2-untied", "mistral"]
EXPORTED_AS = {"qwen2": "Qwen2ForCausalLM", "qwen2-untied": "Qwen2ForCausalLM"}  # the others: a LLaMA


def hf_model(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(name)).eval()
    with torch.no_grad():  # norms start at ones, biases at zeros: perturb everything so every mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def close_to_hf(got, ref):
    """Another implementation of the same fp32 forward: the scaled fp32 bound C_FWD * U32 * max|ref|
    (tolerance.py), as tests/test_hf.py."""
    torch.testing.assert_close(got, ref, **fp32_bound(ref, C_FWD))


def _logits(model, ids=IDS):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, hf_model(request.param)


def test_import_matches_transformers_logits(family):
    name, hf = family
    model = from_hf(hf).eval()
    ref = _logits(hf)
    close_to_hf(_logits(model), ref)
    m = model.cfg.model
    if name.startswith("qwen2"):
        assert m.add_qkv_bias and not m.add_bias_linear
    if name == "llama3-rope-scaling":
        assert m.use_rope_scaling and m.rope_scaling_factor == 4.0
        assert m.rope_scaling_original_max_position_embeddings == 16
    # what the family adds matters: the model without it is measurably another one
    plain = {"llama3-rope-scaling": dict(use_rope_scaling=False),
             "llama-linear-rope": dict(rotary_seq_len_interpolation_factor=None)}.get(name)
    if plain:
        other = from_hf(hf, cfg_overrides=plain).eval()
        assert (_logits(other) - ref).abs().max() > 100 * fp32_bound(ref, C_FWD)["atol"]


def test_greedy_generation_equals_transformers(family):
    name, hf = family
    model = from_hf(hf).eval()
    prompt = IDS[:, :8]
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    got = generate(model, prompt, max_new_tokens=24)
    assert torch.equal(got, want)


def test_export_loads_back_in_transformers(family, tmp_path):
    name, hf = family
    model = from_hf(hf).eval()
    to_hf(model, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(back).__name__ == EXPORTED_AS.get(name, "LlamaForCausalLM")
    close_to_hf(_logits(back), _logits(hf))
    again = config_from_hf(back.config)  # the exported config imports as the same megazero model
    assert again == config_from_hf(hf.config)


def _qwen2_tp2(path):
    mesh = ParallelMesh.build(tp=2)
    model = from_hf(path, mesh).eval()
    return _logits(model)


def test_qwen2_bias_under_tensor_parallelism(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(str(tmp_path))
    for logits in run_ranks(_qwen2_tp2, 2, str(tmp_path)):
        close_to_hf(logits, _logits(hf))


@pytest.mark.parametrize("name,over,needle", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=True; sliding-window"),
    ("mistral", dict(sliding_window=16), "sliding_window=16; sliding-window attention is not implemented"),
    ("llama3-rope-scaling", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_scaling=.*'dynamic'.*'llama3' and 'linear'"),
])
def test_what_megazero_cannot_represent_is_refused_by_name(name, over, needle):
    cfg = family_config(name)
    for k, v in over.items():
        setattr(cfg, k, v)
    if name == "qwen2" and over.get("use_sliding_window"):
        cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    with pytest.raises(ConfigError, match=f"unsupported Hugging Face config: {needle}"):
        config_from_hf(cfg)


def test_a_mistral_window_longer_than_its_context_is_no_window():
    cfg = family_config("mistral")
    cfg.sliding_window = cfg.max_position_embeddings
    assert config_from_hf(cfg)["position_embedding_type"] == "rope"
