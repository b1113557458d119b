"""Hugging Face import/export: randomly initialised transformers models (no download) against
the imported megazero model at TP = 1 and 2, and exact round trips."""
import importlib.util
import os

import pytest
import torch

from megazero.config import ConfigError
from megazero.mesh import ParallelMesh
from megazero.process.local_ranks import run_ranks
from models.hf import config_from_hf, from_hf, to_hf
from tolerance import C_FWD, fp32_bound

transformers = pytest.importorskip("transformers")


def close_to_hf(got, ref):
    """Our forward against transformers' (another implementation of the same fp32 math, and megazero
    keeps norms, RoPE and the loss in fp32, so float64 is not available): the scaled fp32 forward
    bound C_FWD * U32 * max|ref| (~1.8e-5 for logits <= 1.7; was rtol=atol=1e-5 elementwise).
    Observed <= 6 U32 * max|ref|. Round trips through the checkpoint formats stay bit-exact."""
    torch.testing.assert_close(got, ref, **fp32_bound(ref, C_FWD))


def hf_config(kind, **over):
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                       eos_token_id=0, **over)
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, vocab_size=100,
                                    max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6,
                                    bos_token_id=0, eos_token_id=0, **over)


def hf_model(kind, **over):
    torch.manual_seed(0)
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    model = cls(hf_config(kind, **over)).eval()
    with torch.no_grad():  # norms start at ones/zeros: perturb everything so the mapping is tested
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))


def hf_logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module", params=["gpt2", "llama", "llama-tied"])
def saved(request, tmp_path_factory):
    kind = request.param.split("-")[0]
    model = hf_model(kind, **({"tie_word_embeddings": True} if request.param == "llama-tied" else {}))
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return kind, model, path


def test_import_matches_hf_logits_tp1(saved):
    kind, hf, path = saved
    model = from_hf(hf).eval()
    close_to_hf(model(IDS), hf_logits(hf))
    close_to_hf(from_hf(path).eval()(IDS), hf_logits(hf))
    labels = IDS.roll(-1, 1)
    ref = torch.nn.functional.cross_entropy(hf_logits(hf).reshape(-1, 100), labels.reshape(-1),
                                            reduction="none")
    close_to_hf(model(IDS, labels).reshape(-1), ref)


def _import_tp2(path, out_dir):
    mesh = ParallelMesh.build(tp=2)
    model = from_hf(path, mesh).eval()
    with torch.no_grad():
        logits = model(IDS)
    to_hf(model, out_dir)  # collective: gathers the shards, TP rank 0 writes
    return logits


def test_import_tp2_and_export_round_trip(saved, tmp_path):
    kind, hf, path = saved
    out = str(tmp_path / "export")
    for logits in run_ranks(_import_tp2, 2, path, out):
        close_to_hf(logits, hf_logits(hf))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ref = hf.state_dict()
    got = back.state_dict()
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(hf_logits(back), hf_logits(hf), rtol=0, atol=0)
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings


def test_export_from_one_process(saved, tmp_path):
    kind, hf, _ = saved
    to_hf(from_hf(hf), str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(back), hf_logits(hf), rtol=0, atol=0)


@pytest.mark.parametrize("kind,over,field", [
    ("llama", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 2,
                                    "long_factor": [2.0] * 2, "original_max_position_embeddings": 16}),
     "rope_scaling"),  # llama3, linear, yarn, dynamic: tests/test_hf_models.py
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("gpt2", dict(activation_function="relu"), "activation_function"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_hf_config_names_the_field(kind, over, field):
    with pytest.raises(ConfigError, match=f"unsupported Hugging Face config: {field}="):
        config_from_hf(hf_config(kind, **over))


def test_unsupported_model_type():
    with pytest.raises(ConfigError, match="model_type='bert'"):
        config_from_hf(transformers.BertConfig())


def test_convert_script_round_trip(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "convert_hf", os.path.join(os.path.dirname(__file__), "..", "scripts", "convert_hf.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf = hf_model("llama")
    hf.save_pretrained(str(tmp_path / "hf"))
    assert script.main(["--direction", "to-megazero", "--input", str(tmp_path / "hf"),
                        "--output", str(tmp_path / "mz")]) == 0
    assert (tmp_path / "mz" / "latest_checkpointed_iteration.txt").read_text().strip() == "0"  # --save layout
    assert (tmp_path / "mz" / "iter_0000000" / "metadata.json").exists()
    assert script.main(["--direction", "to-hf", "--input", str(tmp_path / "mz"),
                        "--output", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"),
                                                             dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(back), hf_logits(hf), rtol=0, atol=0)
