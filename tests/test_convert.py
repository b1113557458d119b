"""scripts/convert_hf.py at scale: both directions tensor by tensor, --dtype, sharded safetensors with an
index, the tokenizer and generation_config.json carried both ways; and the peak memory of converting a
160M-parameter model, bounded by its largest tensor and one layer (slow)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from models.safetensors_io import HFWeights, ShardedWriter, read_header

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 100


def _script():
    spec = importlib.util.spec_from_file_location("convert_hf", os.path.join(ROOT, "scripts",
                                                                             "convert_hf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tokenizer(directory):
    """A tiny byte-level BPE saved as a Hugging Face tokenizer (tokenizer.json + config)."""
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["to be or not to be that is the question"] * 20, vocab_size=VOCAB - 4,
                            special_tokens=["<s>", "</s>", "<pad>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>",
                                               eos_token="</s>",
                                               pad_token="<pad>")
    tok.save_pretrained(directory)
    return tok


def _hf_dir(kind, directory):
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, **shape)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=False, **shape)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64, **shape)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    _tokenizer(directory)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, temperature=0.7, do_sample=True,
                                  top_k=17).save_pretrained(directory)
    return model


@pytest.mark.parametrize("kind,dtype", [("llama", "bf16"), ("qwen2", "fp16"), ("gpt2", "fp32")])
def test_round_trip_with_dtype_shards_tokenizer_and_generation_config(kind, dtype, tmp_path):
    convert = _script()
    hf = _hf_dir(kind, tmp_path / "hf")
    assert convert.main(["--direction", "to-megazero", "--input", str(tmp_path / "hf"), "--output",
                         str(tmp_path / "mz")]) == 0
    assets = tmp_path / "mz" / "hf_files"
    assert (assets / "tokenizer.json").exists() and (assets / "generation_config.json").exists()
    saved = json.load(open(tmp_path / "mz" / "iter_0000000" / "config.json"))
    assert saved["data"]["tokenizer_model"] == str(assets)  # the checkpoint names its tokenizer
    assert convert.main(["--direction", "to-hf", "--input", str(tmp_path / "mz"), "--output",
                         str(tmp_path / "out"),
                         "--dtype", dtype, "--max-shard-size", "20KB"]) == 0
    out = tmp_path / "out"
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:  # a shard holds at most 20KB of data, or one larger tensor
        header, start = read_header(str(out / f))
        assert os.path.getsize(out / f) - start <= 20_000 or len(header) == 2, f
    want = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").eval()
    assert back.dtype == want and type(back) is type(hf)
    ref = hf.state_dict()
    for name, t in back.state_dict().items():  # every weight is the source's, rounded once to the dtype
        assert torch.equal(t, ref[name].to(want)), name
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("to be or not")["input_ids"] == transformers.AutoTokenizer.from_pretrained(
        str(tmp_path / "hf"))("to be or not")["input_ids"]
    gen = transformers.GenerationConfig.from_pretrained(str(out))
    assert (gen.top_k, gen.temperature, gen.do_sample) == (17, 0.7, True)


def test_writer_and_reader_stream_safetensors_that_safetensors_reads(tmp_path):
    from safetensors.torch import load_file
    tensors = {f"t{i}": torch.randn(7 + i, 3) for i in range(6)}
    w = ShardedWriter(str(tmp_path), max_shard_bytes=150, expected_tensors=len(tensors))
    for name, t in tensors.items():
        w.add(name, t.t() if name == "t0" else t, torch.bfloat16)  # a transposed view too
    files = w.close()
    index = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    # 42, 48, 54, 60, 66, 72 bytes in shards of at most 150: t0-t2 (144), t3-t4 (126), t5
    assert [index[f"t{i}"] for i in range(6)] == [files[0]] * 3 + [files[1]] * 2 + [files[2]]
    loaded = {}
    for f in files:
        loaded.update(load_file(str(tmp_path / f)))
    for name, t in tensors.items():
        assert torch.equal(loaded[name], (t.t() if name == "t0" else t).to(torch.bfloat16).contiguous())
    reader = HFWeights(str(tmp_path))
    assert reader.names() == sorted(tensors) and torch.equal(reader.get("t3"), loaded["t3"])


def test_bad_flags_name_the_flag(tmp_path, capsys):
    convert = _script()
    with pytest.raises(SystemExit):
        convert.main(["--direction", "to-megazero", "--input", str(tmp_path), "--output", str(tmp_path / "x"),
                      "--dtype", "bf16"])
    assert "--dtype bf16 applies to --direction to-hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.main(["--direction", "to-hf", "--input", str(tmp_path), "--output", str(tmp_path / "x"),
                      "--max-shard-size", "lots"])
    assert "--max-shard-size lots" in capsys.readouterr().err


def _llama_with_tokenizer(directory):
    """A tiny random LLaMA with dropout 0 and a tokenizer saved beside it whose special tokens are not
    the class defaults: bos 3, eos 4, pad 1 (the config's eos is a list, as Llama 3's is)."""
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["to be or not to be that is the question"] * 20, vocab_size=VOCAB,
                            special_tokens=["<unk>", "<pad>", "<extra>", "<s>", "</s>"])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>",
                                               eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                   max_position_embeddings=64, attention_dropout=0.0, bos_token_id=3,
                                   eos_token_id=[4, 2], pad_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return tok


@pytest.mark.slow
def test_finetune_with_checkpoint_args_exports_the_sources_dropout_tokenizer_and_ids(tmp_path, monkeypatch):
    """--use-checkpoint-args takes the dropout and the tokenizer from a converted checkpoint (as
    Megatron-LM does): the fine-tune trains without dropout, and its export has attention_dropout 0.0,
    the source's tokenizer files and the source's bos/eos/pad ids (not the LlamaConfig defaults 1, 2)."""
    from megazero.config import parse_args
    from models.cli import pretrain_main
    convert, src = _script(), tmp_path / "hf"
    tok = _llama_with_tokenizer(str(src))
    assert convert.main(["--direction", "to-megazero", "--input", str(src), "--output",
                         str(tmp_path / "ck")]) == 0
    monkeypatch.chdir(tmp_path)  # relative paths: the run records where its tokenizer is, absolutely
    argv = ["--load", "ck", "--finetune", "--use-checkpoint-args", "--mock-data", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4"]
    cfg = parse_args(argv)
    assert (cfg.model.hidden_dropout, cfg.model.attention_dropout) == (0.0, 0.0)
    assert cfg.data.tokenizer_model == str(tmp_path / "ck" / "hf_files")
    assert pretrain_main(argv + ["--save", "run"]) == 0
    monkeypatch.chdir(tmp_path / "ck")  # the export, from elsewhere
    assert convert.main(["--direction", "to-hf", "--input", "../run", "--output", "../out"]) == 0
    out = json.load(open(tmp_path / "out" / "config.json"))
    assert out["attention_dropout"] == 0.0
    assert (out["bos_token_id"], out["eos_token_id"], out["pad_token_id"]) == (3, [4, 2], 1)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "out"))
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert back("to be or not")["input_ids"] == tok("to be or not")["input_ids"]
    assert (back.bos_token_id, back.eos_token_id) == (3, 4)


def test_checkpoint_args_given_flags_win_and_a_missing_tokenizer_is_named(tmp_path, monkeypatch):
    """Flags given beside --use-checkpoint-args win over the checkpoint's (dropout, tokenizer);
    --no-use-tokenizer-model-from-checkpoint-args keeps none; a tokenizer the checkpoint names but that
    is gone is an error naming the flags."""
    from megazero.checkpoint import save_weights
    from megazero.config import ConfigError, config_from_dict, parse_args, validate
    from megazero.mesh import ParallelMesh
    import models
    from doc_commands import make_stand_ins
    monkeypatch.chdir(tmp_path)
    make_stand_ins(["--tokenizer-model", "tok.model"])
    cfg = validate(config_from_dict(dict(models.PRESETS["tiny-llama"], mock_data=True, hidden_dropout=0.0,
                                         attention_dropout=0.0, tokenizer_model="tok.model")), 1)
    save_weights("ck", [models.build_model(cfg)], ParallelMesh.single(), cfg)
    base = ["--load", "ck", "--finetune", "--use-checkpoint-args", "--mock-data"]
    taken = parse_args(base)
    assert (taken.model.attention_dropout, taken.data.tokenizer_model) == (0.0, str(tmp_path / "tok.model"))
    given = parse_args(base + ["--attention-dropout", "0.2", "--tokenizer-type", "NullTokenizer",
                               "--vocab-size", "64"])
    assert (given.model.attention_dropout, given.data.tokenizer_model) == (0.2, None)
    for flag in ("--no-use-tokenizer-model-from-checkpoint-args",
                 "--disable-use-tokenizer-model-from-checkpoint-args"):
        assert parse_args(base + [flag]).data.tokenizer_model is None
    os.remove("tok.model")
    with pytest.raises(ConfigError, match=r"the checkpoint's tokenizer \(--tokenizer-model .*tok.model\) is "
                                          r"not found from here; pass --tokenizer-model PATH, or "
                                          r"--no-use-tokenizer-model-from-checkpoint-args"):
        parse_args(base)


def test_to_hf_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys):
    """As --load does (docs/operations.md): a block of the newest checkpoint that fails its checksum
    while it is exported makes to-hf export the previous one, say why, and leave no partial shard;
    --iteration N asked for the damaged one is an error naming the file; nothing usable names each."""
    from safetensors.torch import load_file
    from megazero.checkpoint import checkpoint_path, read_weights, save_weights
    from megazero.config import config_from_dict, validate
    from megazero.mesh import ParallelMesh
    import models
    convert, d = _script(), str(tmp_path / "ck")
    cfg = validate(config_from_dict(dict(models.PRESETS["tiny-llama"], mock_data=True)), 1)
    model = models.build_model(cfg)
    save_weights(d, [model], ParallelMesh.single(), cfg, iteration=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_weights(d, [model], ParallelMesh.single(), cfg, iteration=2)
    shard = os.path.join(checkpoint_path(d, 2), "shard_tp00_pp000_dp000.bin")
    data = bytearray(open(shard, "rb").read())
    data[len(data) * 3 // 4] ^= 0x5A
    open(shard, "wb").write(bytes(data))
    out = tmp_path / "out"
    assert convert.main(["--direction", "to-hf", "--input", d, "--output", str(out), "--iteration", "2"]) == 2
    assert "shard_tp00_pp000_dp000.bin" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == []  # the partial export was removed
    assert convert.main(["--direction", "to-hf", "--input", d, "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "(iteration 1; not the newest: skipped" in said and "shard_tp00_pp000_dp000.bin" in said
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    exported = load_file(str(out / "model.safetensors"))
    _, _, _, weights = read_weights(d, 1)
    embedding = next(v for k, v in weights.items() if k.endswith("word_embeddings.weight"))
    assert torch.equal(exported["model.embed_tokens.weight"], embedding)  # iteration 1's, not 2's
    os.remove(os.path.join(checkpoint_path(d, 1), "shard_tp00_pp000_dp000.bin"))
    assert convert.main(["--direction", "to-hf", "--input", d, "--output", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "iter_0000002" in err and "iter_0000001" in err


# ---- peak memory at 160M parameters --------------------------------------------------------------
BIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
MEASURE = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch, transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaConfig  # noqa: F401
import models, models.hf, models.hf_convert, models.checkpoint, megazero.checkpoint
sys.argv = ["convert_hf.py"] + {argv!r}
spec = __import__("importlib.util").util.spec_from_file_location("c", {script!r})
c = __import__("importlib.util").util.module_from_spec(spec); spec.loader.exec_module(c)
assert c.main({warm!r}) == 0  # a tiny model first: lazy imports and set-up are not the conversion's
before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
start = time.monotonic()
assert c.main(sys.argv[1:]) == 0
seconds = time.monotonic() - start
# VmHWM, this process's peak resident set (ru_maxrss would carry the parent's, from before the exec)
peak = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print(json.dumps({{"before": before, "peak": peak, "seconds": seconds}}))
"""


def _measure(argv, warm):
    code = MEASURE.format(root=ROOT, argv=argv, warm=warm, script=os.path.join(ROOT, "scripts",
                                                                               "convert_hf.py"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_converting_160m_parameters_holds_a_tensor_and_a_layer_not_the_model(tmp_path):
    cfg = transformers.LlamaConfig(**BIG)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(cfg)
    shapes = {n: p.shape for n, p in skeleton.named_parameters()}
    total = sum(s.numel() for s in shapes.values())
    src = tmp_path / "hf"
    cfg.save_pretrained(str(src))
    writer = ShardedWriter(str(src), 2 << 30, len(shapes))  # bf16, written a tensor at a time
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add(name, torch.randn(shape, generator=g).mul_(0.02), torch.bfloat16)
    writer.close()
    largest = max(s.numel() for s in shapes.values()) * 4  # fp32, as megazero holds it
    layer = sum(s.numel() for n, s in shapes.items() if n.startswith("model.layers.0.")) * 4
    bound = 1.2 * largest + layer
    assert total * 4 >= 3 * bound  # the model in fp32 is over three times what the conversion may hold
    _hf_dir("llama", tmp_path / "tiny")
    tiny = ["--direction", "to-megazero", "--input", str(tmp_path / "tiny"), "--output",
            str(tmp_path / "tiny-mz")]
    to_mz = _measure(["--direction", "to-megazero", "--input", str(src), "--output", str(tmp_path / "mz")],
                     tiny)
    to_hf = _measure(["--direction", "to-hf", "--input", str(tmp_path / "mz"), "--output",
                      str(tmp_path / "out"),
                      "--dtype", "bf16", "--max-shard-size", "200MB"],
                     ["--direction", "to-hf", "--input", str(tmp_path / "tiny-mz"), "--output",
                      str(tmp_path / "tiny-out"), "--dtype", "bf16"])
    report = {k: (m["peak"] - m["before"]) / 2 ** 20 for k, m in (("to-megazero", to_mz), ("to-hf", to_hf))}
    mib = {k: m["peak"] / 2 ** 20 for k, m in (("to-megazero", to_mz), ("to-hf", to_hf))}
    print(f"\nwhole-process peak RSS MiB: {mib} "
          f"(of which Python, torch and transformers {to_mz['before'] / 2 ** 20:.0f})")
    print(f"\n{total / 1e6:.0f}M-parameter conversion, peak RSS growth MiB: {report}; bound "
          f"{bound / 2 ** 20:.0f} MiB (1.2 x largest tensor {largest / 2 ** 20:.0f} + layer "
          f"{layer / 2 ** 20:.0f}); "
          f"model {total * 4 / 2 ** 20:.0f} MiB in fp32; seconds: to-megazero {to_mz['seconds']:.1f}, "
          f"to-hf {to_hf['seconds']:.1f}")
    for direction, grew in report.items():
        assert grew * 2 ** 20 <= bound, (direction, report)
    back = HFWeights(str(tmp_path / "out"))
    source = HFWeights(str(src))
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight", "lm_head.weight"):
        assert torch.equal(back.get(name), source.get(name)), name  # bf16 -> fp32 -> bf16 is exact
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert len(index["weight_map"]) == len(shapes)
