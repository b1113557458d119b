"""Files that come from outside (issue 42): a Hugging Face directory's files stay inside it, its
safetensors headers are bounded and checked, every tensor it holds is used (or ``--allow-unused-weights``
drops the rest), and a malformed one is one line naming the file with exit status 2 from
``scripts/convert_hf.py``; an indexed dataset labelled with the wrong dtype is refused naming its file.

The model directories are written by hand (a tiny LLaMA: config.json and safetensors files)."""
import importlib.util
import json
import os
import struct

import numpy as np
import pytest
import torch

from megazero.errors import ConfigError

safetensors_torch = pytest.importorskip("safetensors.torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 16, 32, 32, 2, 1
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=HIDDEN,
              intermediate_size=FFN, num_hidden_layers=1, num_attention_heads=HEADS,
              num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=32, rms_norm_eps=1e-6,
              hidden_act="silu", tie_word_embeddings=False)


def _script():
    path = os.path.join(ROOT, "scripts", "convert_hf.py")
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tensors(layers=1, tied=False):
    """A tiny LLaMA's tensors under transformers' names, ``layers`` layers of them."""
    g = torch.Generator().manual_seed(0)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "model.norm.weight": [HIDDEN]}
    if not tied:
        shapes["lm_head.weight"] = [VOCAB, HIDDEN]
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in {
            "input_layernorm.weight": [HIDDEN], "post_attention_layernorm.weight": [HIDDEN],
            "self_attn.q_proj.weight": [HIDDEN, HIDDEN], "self_attn.k_proj.weight": [kv, HIDDEN],
            "self_attn.v_proj.weight": [kv, HIDDEN], "self_attn.o_proj.weight": [HIDDEN, HIDDEN],
            "mlp.gate_proj.weight": [FFN, HIDDEN], "mlp.up_proj.weight": [FFN, HIDDEN],
            "mlp.down_proj.weight": [HIDDEN, FFN]}.items()})
    return {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}


def _model_dir(directory, tensors=None, **config):
    """``directory`` with config.json (CONFIG changed by ``config``) and model.safetensors."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(dict(CONFIG, **config), fh)
    tied = config.get("tie_word_embeddings", False)
    safetensors_torch.save_file(_tensors(tied=tied) if tensors is None else tensors,
                                os.path.join(directory, "model.safetensors"))
    return str(directory)


def _convert(src, dst, capsys, *flags):
    """``(exit status, stderr lines)`` of convert_hf.py --direction to-megazero."""
    code = _script().main(["--direction", "to-megazero", "--input", str(src), "--output", str(dst), *flags])
    return code, capsys.readouterr().err.strip().splitlines()


# ---- (a) files stay inside the model directory -----------------------------------------------------
@pytest.mark.parametrize("how", ["parent", "absolute", "link"])
def test_a_shard_outside_the_model_directory_is_refused(tmp_path, capsys, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    safetensors_torch.save_file(_tensors(), str(outside / "x.safetensors"))  # a valid file, elsewhere
    src = tmp_path / "model"
    _model_dir(src)
    os.remove(src / "model.safetensors")
    name = {"parent": "../outside/x.safetensors", "absolute": str(outside / "x.safetensors"),
            "link": "x.safetensors"}[how]
    if how == "link":
        os.symlink(outside / "x.safetensors", src / "x.safetensors")
    with open(src / "model.safetensors.index.json", "w") as fh:
        json.dump({"metadata": {}, "weight_map": {n: name for n in sorted(_tensors())}}, fh)
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert str(src / "model.safetensors.index.json") in err[0]
    assert "weight_map entry 'lm_head.weight'" in err[0]
    assert repr(name) in err[0] and "outside" in err[0]
    assert not (tmp_path / "ckpt").exists()


def test_a_tokenizer_file_linked_from_outside_is_not_copied(tmp_path, capsys):
    src = tmp_path / "model"
    _model_dir(src)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the checkpoint")
    os.symlink(secret, src / "tokenizer.json")
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1 and "tokenizer.json" in err[0] and "outside" in err[0], err
    assert not (tmp_path / "ckpt" / "hf_files" / "tokenizer.json").exists()


def test_a_hub_cache_snapshot_links_into_its_blobs(tmp_path, capsys):
    """transformers' cache keeps a revision's files in snapshots/<rev>/ as links to ../../blobs/: those
    resolve outside the snapshot directory and are accepted; a link elsewhere is not."""
    repo = tmp_path / "models--tiny--llama"
    snapshot = repo / "snapshots" / "abc123"
    _model_dir(repo / "blobs" / "staging")
    os.makedirs(snapshot)
    for f in ("config.json", "model.safetensors"):
        os.replace(repo / "blobs" / "staging" / f, repo / "blobs" / f"sha-{f}")
        os.symlink(os.path.join("..", "..", "blobs", f"sha-{f}"), snapshot / f)
    code, err = _convert(snapshot, tmp_path / "ckpt", capsys)
    assert code == 0, err
    os.remove(snapshot / "model.safetensors")
    os.symlink(os.path.join("..", "..", "..", "elsewhere.safetensors"), snapshot / "model.safetensors")
    safetensors_torch.save_file(_tensors(), str(tmp_path / "elsewhere.safetensors"))
    code, err = _convert(snapshot, tmp_path / "ckpt2", capsys)
    assert code == 2 and "outside" in err[0], err


# ---- (b) safetensors headers -----------------------------------------------------------------------
def _raw_safetensors(path, header, data=b"", length=None):
    text = json.dumps(header).encode() if isinstance(header, dict) else header
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text) if length is None else length) + text + data)


GOOD = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
BAD_HEADERS = {
    "length beyond the file": (dict(t=GOOD), 1 << 60, "announce a header of 1152921504606846976 bytes"),
    "not JSON": (b"{'t': nonsense", None, "not JSON"),
    "not an object": (b"[1, 2, 3]", None, "not a JSON object"),
    "unknown dtype": (dict(t=dict(GOOD, dtype="Q4")), None, "tensor 't' has dtype 'Q4'"),
    "bad shape": (dict(t=dict(GOOD, shape=[2, -3])), None, "tensor 't' has shape"),
    "offsets outside the file": (dict(t=dict(GOOD, data_offsets=[0, 4000])), None,
                                 r"data_offsets \[0, 4000\]"),
    "offsets that disagree with the shape": (dict(t=dict(GOOD, shape=[3, 3])), None, "needs 36 bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_a_malformed_safetensors_header_is_refused_naming_the_file(tmp_path, case):
    from models.safetensors_io import read_header
    header, length, message = BAD_HEADERS[case]
    path = str(tmp_path / "model.safetensors")
    _raw_safetensors(path, header, bytes(24), length)
    with pytest.raises(ConfigError, match=f"{path}: .*{message}"):
        read_header(path)


def test_a_text_file_as_the_weights_is_one_line(tmp_path, capsys):
    """/etc/passwd's first 8 bytes read as a header length of about 7.9e18 bytes."""
    src = tmp_path / "model"
    _model_dir(src)
    with open(src / "model.safetensors", "w") as fh:
        fh.write("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{src / 'model.safetensors'}: not a safetensors file" in err[0]


# ---- (c) every tensor is used -----------------------------------------------------------------------
def test_weights_of_more_layers_than_the_config_are_refused_unless_allowed(tmp_path, capsys):
    from models.hf_convert import to_megazero
    src = _model_dir(tmp_path / "model", _tensors(layers=2), num_hidden_layers=1)
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert "'model.layers.1." in err[0] and "9 unused tensors" in err[0]
    assert "--allow-unused-weights" in err[0]
    assert not (tmp_path / "ckpt").exists()
    code = _script().main(["--direction", "to-megazero", "--input", src, "--output", str(tmp_path / "ckpt"),
                           "--allow-unused-weights"])
    assert code == 0 and "dropped 9 unused tensors (the first: model.layers.1." in capsys.readouterr().out
    saved = json.load(open(tmp_path / "ckpt" / "iter_0000000" / "config.json"))
    assert saved["model"]["num_layers"] == 1
    with pytest.raises(ConfigError, match="model.layers.1"):  # the Python API alike
        to_megazero(src, str(tmp_path / "api"))
    to_megazero(src, str(tmp_path / "api"), allow_unused_weights=True)


def test_buffers_and_a_tied_head_equal_to_the_embeddings_are_not_unused(tmp_path, capsys):
    tensors = _tensors(tied=True)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # some exports write it
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(HIDDEN // HEADS // 2)
    src = _model_dir(tmp_path / "model", tensors, tie_word_embeddings=True)
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 0, err
    tensors["lm_head.weight"] += 1  # a head that is not the embeddings: the tie would lose it
    src = _model_dir(tmp_path / "model2", tensors, tie_word_embeddings=True)
    code, err = _convert(src, tmp_path / "ckpt2", capsys)
    assert code == 2 and "'lm_head.weight'" in err[0] and "ties the head" in err[0], err


def test_gpt2_causal_mask_buffers_are_not_unused(tmp_path, capsys):
    h, g = HIDDEN, torch.Generator().manual_seed(0)
    shapes = {"transformer.wte.weight": [VOCAB, h], "transformer.wpe.weight": [16, h],
              "transformer.ln_f.weight": [h], "transformer.ln_f.bias": [h]}
    shapes.update({f"transformer.h.0.{k}": v for k, v in {
        "ln_1.weight": [h], "ln_1.bias": [h], "ln_2.weight": [h], "ln_2.bias": [h],
        "attn.c_attn.weight": [h, 3 * h], "attn.c_attn.bias": [3 * h], "attn.c_proj.weight": [h, h],
        "attn.c_proj.bias": [h], "mlp.c_fc.weight": [h, 4 * h], "mlp.c_fc.bias": [4 * h],
        "mlp.c_proj.weight": [4 * h, h], "mlp.c_proj.bias": [h]}.items()})
    tensors = {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16).tril()  # older exports' buffers
    tensors["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    config = dict(model_type="gpt2", n_embd=h, n_layer=1, n_head=HEADS, n_positions=16, vocab_size=VOCAB,
                  activation_function="gelu_new", tie_word_embeddings=True, bos_token_id=0,
                  eos_token_id=0)
    src = tmp_path / "gpt2"
    with open(_model_dir(src, tensors) + "/config.json", "w") as fh:
        json.dump(config, fh)
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 0, err
    tensors["transformer.h.0.attn.c_attn.extra"] = torch.zeros(1)  # but not any tensor under attn
    safetensors_torch.save_file(tensors, str(src / "model.safetensors"))
    code, err = _convert(src, tmp_path / "ckpt2", capsys)
    assert code == 2 and "'transformer.h.0.attn.c_attn.extra'" in err[0], err


# ---- (d) malformed inputs: one line, exit status 2 ---------------------------------------------------
BAD_CONFIGS = {
    "unreadable JSON": ("{not json", "not valid JSON"),
    "no model_type": ({k: v for k, v in CONFIG.items() if k != "model_type"}, "no model_type"),
    "unknown architecture": (dict(CONFIG, model_type="nosuchmodel"), "model_type='nosuchmodel'"),
    "architecture megazero lacks": (dict(CONFIG, model_type="olmo3"), "OLMo 3"),
    "wrong type": (dict(CONFIG, hidden_size="big"), "hidden_size"),
    "missing key (a default of another shape)": ({k: v for k, v in CONFIG.items() if k != "hidden_size"},
                                                 "needs \\[32, 4096\\]"),
    "missing rope key": (dict(CONFIG, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "factor"),
    "impossible value": (dict(CONFIG, num_attention_heads=3), ""),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_malformed_config_is_one_line_and_exit_status_2(tmp_path, capsys, case):
    import re
    config, message = BAD_CONFIGS[case]
    src = tmp_path / "model"
    _model_dir(src)
    with open(src / "config.json", "w") as fh:
        fh.write(config if isinstance(config, str) else json.dumps(config))
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert str(src / "config.json") in err[0] and re.search(message, err[0]), err


def test_a_missing_shard_a_missing_tensor_and_a_wrong_shape_are_one_line(tmp_path, capsys):
    src = tmp_path / "model"
    _model_dir(src)
    tensors = _tensors()
    os.remove(src / "model.safetensors")
    names = sorted(tensors)
    halves = {"a.safetensors": names[:8], "b.safetensors": names[8:]}
    safetensors_torch.save_file({n: tensors[n] for n in halves["a.safetensors"]},
                                str(src / "a.safetensors"))
    with open(src / "model.safetensors.index.json", "w") as fh:
        json.dump({"weight_map": {n: f for f, ns in halves.items() for n in ns}}, fh)
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert str(src / "model.safetensors.index.json") in err[0]
    assert "'b.safetensors', which is not in" in err[0]
    os.remove(src / "model.safetensors.index.json")
    os.remove(src / "a.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, str(src / "model.safetensors"))
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1 and "no tensor 'model.layers.0.mlp.up_proj.weight'" in err[0], err
    tensors = _tensors()  # a transposed projection: as many values, another shape
    down = "model.layers.0.mlp.down_proj.weight"
    tensors[down] = tensors[down].t().contiguous()
    safetensors_torch.save_file(tensors, str(src / "model.safetensors"))
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert "'model.layers.0.mlp.down_proj.weight': [32, 16]" in err[0] and "needs [16, 32]" in err[0]
    assert not (tmp_path / "ckpt").exists()


def test_a_pytorch_bin_is_read_and_one_that_is_not_a_state_dict_is_one_line(tmp_path, capsys):
    src = tmp_path / "model"
    _model_dir(src)
    os.remove(src / "model.safetensors")
    torch.save(_tensors(), str(src / "pytorch_model.bin"))
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 0, err
    with open(src / "pytorch_model.bin", "wb") as fh:
        fh.write(b"PK\x03\x04 not really a zip file" * 4)
    code, err = _convert(src, tmp_path / "ckpt2", capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{src / 'pytorch_model.bin'}: not a PyTorch weights file" in err[0]


def test_a_config_of_more_layers_than_the_weights_is_refused_before_it_is_built(tmp_path, capsys):
    """Building the model's skeleton takes time in proportion to its layers (about 2 ms a layer here):
    5000 layers would take seconds, a million half an hour."""
    import time
    src = _model_dir(tmp_path / "model", num_hidden_layers=5000)
    start = time.monotonic()
    code, err = _convert(src, tmp_path / "ckpt", capsys)
    assert code == 2 and len(err) == 1, err
    assert "config.json describes 5000 layers, but its weight files hold no tensor of layer 1" in err[0]
    assert time.monotonic() - start < 5


# ---- (e) an indexed dataset labelled with the wrong dtype --------------------------------------------
def _relabelled(tmp_path, dtype, docs, code):
    """An indexed dataset written in ``dtype`` whose .idx then says dtype ``code``."""
    from megazero.data.indexed import MAGIC, IndexedDatasetWriter
    prefix = str(tmp_path / "corpus_text_document")
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
    with open(prefix + ".idx", "r+b") as fh:
        fh.seek(len(MAGIC) + 8)
        fh.write(bytes([code]))
    return prefix


def test_an_index_with_the_wrong_dtype_code_names_its_file(tmp_path):
    from megazero.data.gpt_dataset import BlendedGPTData
    from megazero.data.indexed import IndexedDataset
    prefix = _relabelled(tmp_path / "a", np.int32, [[1, 2, 3, 4]], 7)  # int32 ids labelled float32
    with pytest.raises(ValueError, match=f"{prefix}.idx: dtype code 7 \\(float32\\) is not an integer"):
        IndexedDataset(prefix)
    prefix = _relabelled(tmp_path / "b", np.uint16, [[1, 2, 3, 4]], 4)  # uint16 ids labelled int32
    with pytest.raises(ValueError, match=f"{prefix}.bin: 8 bytes, but {prefix}.idx describes .* code 4"):
        IndexedDataset(prefix)
    prefix = _relabelled(tmp_path / "c", np.uint16, [[40000, 2, 3] * 30], 3)  # uint16 ids labelled int16
    data = BlendedGPTData([prefix], 8, "1,0,0", vocab_size=50257)
    with pytest.raises(ValueError, match=f"{prefix}.bin: token id -25536 .* {prefix}.idx says .* int16"):
        data.check_vocab()
