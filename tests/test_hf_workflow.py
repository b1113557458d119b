"""The whole user workflow from Hugging Face weights: convert to a checkpoint, fine-tune under
TP 2 x PP 2 x DP 2 with ZeRO-2 (pretrain_gpt.py --load --finetune --use-checkpoint-args), export the
result back to Hugging Face, and generate with it; tiny random GPT-2 and LLaMA (grouped-query
attention, untied head) built here, nothing downloaded.

Comparisons: losses and logits against transformers computed in float64; megazero runs in fp32
(its norms compute in fp32 whatever the input), so 1e-5 bounds fp32 rounding over two layers
(observed differences are below 1e-6)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megazero.data.mock import MockGPTData
from megazero.process.local_ranks import run_ranks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # end to end: 8-rank fine-tuning runs, subprocesses
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, GBS, SEED, VOCAB = 16, 4, 1234, 100
PROMPT = [5, 17, 42, 7, 99, 3]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_hf(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                       max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6,
                                       bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms start at ones/zeros: perturb everything so every mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def workflow(request, tmp_path_factory):
    """HF model -> checkpoint -> 3 fine-tuning steps on 8 ranks -> exported HF directory."""
    kind, d = request.param, tmp_path_factory.mktemp(request.param)
    hf = tiny_hf(kind)
    hf.save_pretrained(str(d / "hf"))
    convert = _script("convert_hf")
    assert convert.main(["--direction", "to-megazero", "--input", str(d / "hf"),
                         "--output", str(d / "ckpt")]) == 0
    argv = ["--load", str(d / "ckpt"), "--finetune", "--use-checkpoint-args", "--mock-data",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "2",
            "--seq-length", str(SEQ), "--micro-batch-size", "1", "--global-batch-size", str(GBS),
            "--train-iters", "3", "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", str(SEED),
            "--hidden-dropout", "0", "--attention-dropout", "0",  # no dropout: the first loss is HF's
            "--save", str(d / "run"), "--metrics-file", str(d / "metrics.jsonl")]
    assert run_ranks(_pretrain, 8, argv, timeout=300) == [0] * 8
    assert convert.main(["--direction", "to-hf", "--input", str(d / "run"),
                         "--output", str(d / "exported")]) == 0
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    return kind, hf, d, rows


def test_first_finetune_loss_equals_hf_loss(workflow):
    kind, hf, d, rows = workflow
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[0]["consumed_samples"] == GBS
    tokens = MockGPTData(VOCAB, SEQ, seed=SEED).get_tokens(list(range(GBS)), "train")  # the first batch
    with torch.no_grad():
        logits = hf.double()(tokens[:, :-1]).logits
    hf.float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
    assert rows[0]["loss"] == pytest.approx(want, abs=1e-5)
    assert rows[2]["loss"] != rows[0]["loss"]  # it trained


def test_export_logits_equal_megazero_logits(workflow):
    from models.checkpoint import load_model
    kind, hf, d, rows = workflow
    back = transformers.AutoModelForCausalLM.from_pretrained(str(d / "exported"), dtype=torch.float64).eval()
    assert type(back) is type(hf)
    model, info = load_model(str(d / "run"))
    assert info["iteration"] == 3
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).double(), back(ids).logits, rtol=0, atol=1e-5)
        moved = (back(ids).logits - hf.double()(ids).logits).abs().max().item()
    hf.float()
    assert moved > 1e-4  # the exported weights are the fine-tuned ones, not the originals


def test_generate_greedy_equals_transformers(workflow):
    kind, hf, d, rows = workflow
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"),
                           "--load", str(d / "run"),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(d / "exported"), dtype=torch.float32).eval()
    back.generation_config.eos_token_id = None  # generate the full length, as generate.py does
    back.generation_config.pad_token_id = 0
    want = back.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)[0].tolist()
    assert got["ids"] == want and got["prompt_ids"] == PROMPT and got["text"] is None


def _train_with_tokenizer(argv):
    from megazero.config import parse_args
    from megazero.training import train
    import models
    return train(parse_args(argv), models.build_chunks)


def test_exported_run_with_a_sentencepiece_tokenizer_works_in_a_pipeline(tmp_path):
    """A run that used --tokenizer-model exports its tokenizer too: transformers.pipeline generates
    the same greedy text as generate.py."""
    import sentencepiece as spm
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(["To be, or not to be, that is the question:",
                               "Whether 'tis nobler in the mind to suffer",
                               "The slings and arrows of outrageous fortune,"] * 30))
    spm.SentencePieceTrainer.Train(input=str(text), model_prefix=str(tmp_path / "tok"), vocab_size=64,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=3, minloglevel=2)
    tok = str(tmp_path / "tok.model")
    _train_with_tokenizer(["--mock-data", "--tokenizer-model", tok,
                           "--num-layers", "2", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--seq-length", "32", "--train-iters", "2",
                           "--micro-batch-size", "2", "--init-method-std", "0.3",
                           "--save", str(tmp_path / "run"), "--hidden-dropout", "0",
                           "--attention-dropout", "0"])
    convert = _script("convert_hf")
    assert convert.main(["--direction", "to-hf", "--input", str(tmp_path / "run"),
                         "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    pipe = transformers.pipeline("text-generation", str(tmp_path / "hf"))
    pipe.model.generation_config.eos_token_id = None
    pipe.model.generation_config.pad_token_id = 3
    want = pipe("To be, or not", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    gen = _script("generate")
    got = gen.run(gen.parse_args(["--load", str(tmp_path / "run"), "--prompt", "To be, or not",
                                  "--max-new-tokens", "8"]))
    assert got["text"] == want and len(got["ids"]) == len(got["prompt_ids"]) + 8
