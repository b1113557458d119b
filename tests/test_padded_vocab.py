"""Fine-tuning a Hugging Face model whose vocabulary is padded beyond its tokenizer (Qwen2.5, Qwen3, Phi-3
and OLMo 2 ship such models): a tiny random Qwen3 with ``vocab_size`` 512 and a 400-entry tokenizer goes
through the documented path, ``convert_hf.py --direction to-megazero``, then ``pretrain_gpt.py --load CK
--finetune --use-checkpoint-args``.  The checkpoint's 512 rows win over the tokenizer's 400 ids (as
Megatron-LM's --use-checkpoint-args takes the checkpoint's padded vocabulary); the first loss is
transformers' own loss of that batch (float64; 1e-5 bounds fp32 rounding over two layers); the export
keeps the source's bos/eos/pad ids and the 512 rows.  A tokenizer with more ids than the checkpoint's
rows is refused in one line, exit status 2."""
import importlib.util
import json
import os

import pytest
import torch

from megazero.data.mock import MockGPTData
from tiny_tokenizer import tiny_qwen3, tiny_tokenizer

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, GBS, SEED, VOCAB, TOKENS = 16, 2, 1234, 512, 400


def _convert(argv):
    path = os.path.join(ROOT, "scripts", "convert_hf.py")
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


def _finetune_argv(ckpt, *more):
    return ["--load", str(ckpt), "--finetune", "--use-checkpoint-args", "--mock-data",
            "--seq-length", str(SEQ),
            "--micro-batch-size", "1", "--global-batch-size", str(GBS), "--train-iters", "3", "--lr", "1e-2",
            "--lr-decay-style", "constant", "--seed", str(SEED), "--hidden-dropout", "0",
            "--attention-dropout", "0", *more]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """Qwen3 (512 rows, 400-id tokenizer) -> checkpoint -> 3 fine-tuning steps -> HF directory."""
    d = tmp_path_factory.mktemp("padded")
    tok = tiny_tokenizer(d / "hf", TOKENS)
    hf = tiny_qwen3(d / "hf", VOCAB, tok)
    assert _convert(["--direction", "to-megazero", "--input", str(d / "hf"),
                     "--output", str(d / "ckpt")]) == 0
    assert _pretrain(_finetune_argv(d / "ckpt", "--save", str(d / "run"),
                                    "--metrics-file", str(d / "metrics.jsonl"))) == 0
    assert _convert(["--direction", "to-hf", "--input", str(d / "run"), "--output", str(d / "exported")]) == 0
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    return d, tok, hf, rows


def test_padded_vocabulary_finetunes_with_the_checkpoints_rows(padded):
    d, tok, hf, rows = padded
    saved = json.load(open(d / "run" / "iter_0000003" / "config.json"))
    assert saved["model"]["vocab_size"] == VOCAB and len(tok) == TOKENS
    assert saved["data"]["tokenizer_model"] == str(d / "ckpt" / "hf_files")  # the checkpoint's tokenizer
    tokens = MockGPTData(VOCAB, SEQ, seed=SEED).get_tokens(list(range(GBS)), "train")  # the first batch
    with torch.no_grad():
        logits = hf.double()(tokens[:, :-1]).logits
    hf.float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert rows[0]["loss"] == pytest.approx(want, abs=1e-5)
    assert rows[2]["loss"] != rows[0]["loss"]  # it trained (random tokens: the loss need not fall)


def test_the_export_keeps_the_rows_and_the_special_ids(padded):
    from models.checkpoint import load_model
    d, tok, hf, rows = padded
    config = json.load(open(d / "exported" / "config.json"))
    assert config["vocab_size"] == VOCAB
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(hf.config, key) is not None, key
    assert len(transformers.AutoTokenizer.from_pretrained(str(d / "exported"))) == TOKENS
    back = transformers.AutoModelForCausalLM.from_pretrained(str(d / "exported"), dtype=torch.float64).eval()
    model, info = load_model(str(d / "run"))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).double(), back(ids).logits, rtol=0, atol=1e-5)
        moved = (back(ids).logits - hf.double()(ids).logits).abs().max().item()
    hf.float()
    assert info["iteration"] == 3 and moved > 1e-4  # the exported weights are the fine-tuned ones


def test_the_start_up_names_the_padded_vocabulary(padded):
    from megazero.config import parse_args
    d = padded[0]
    cfg = parse_args(_finetune_argv(d / "ckpt"), world_size=1)
    assert cfg.model.vocab_size == VOCAB
    assert any("the checkpoint's 512 rows, padding the tokenizer's 400 ids" in n for n in cfg.notes)


def test_a_tokenizer_larger_than_the_checkpoint_is_one_line(tmp_path, capfd):
    tok = tiny_tokenizer(tmp_path / "hf", TOKENS)
    tiny_qwen3(tmp_path / "hf", 384, tok)  # 384 rows for 400 ids: a mismatched tokenizer and vocabulary
    assert _convert(["--direction", "to-megazero", "--input", str(tmp_path / "hf"),
                     "--output", str(tmp_path / "ckpt")]) == 0
    capfd.readouterr()
    assert _pretrain(_finetune_argv(tmp_path / "ckpt")) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--use-checkpoint-args" in err[0]
    assert "400 ids" in err[0] and "384 rows" in err[0]


def test_without_the_checkpoints_tokenizer_the_export_still_keeps_the_special_ids(padded, tmp_path):
    """--no-use-tokenizer-model-from-checkpoint-args: a run without a tokenizer; its export takes the
    bos/eos/pad ids the converted checkpoint recorded (they were null before)."""
    d, tok, hf, rows = padded
    argv = _finetune_argv(d / "ckpt", "--no-use-tokenizer-model-from-checkpoint-args", "--save",
                          str(tmp_path / "run"))
    argv[argv.index("--train-iters") + 1] = "1"
    assert _pretrain(argv) == 0
    assert _convert(["--direction", "to-hf", "--input", str(tmp_path / "run"), "--output",
                     str(tmp_path / "exported")]) == 0
    config = json.load(open(tmp_path / "exported" / "config.json"))
    assert config["vocab_size"] == VOCAB
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(hf.config, key) is not None, key
