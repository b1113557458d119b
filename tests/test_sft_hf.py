"""--sft from a Hugging Face import, end to end: a tiny random Qwen3 of 512 rows with a 400-entry ChatML
tokenizer (a padded vocabulary) is converted, then fine-tuned on multi-turn conversations with
``--finetune --use-checkpoint-args --sft --reset-attention-mask --reset-position-ids`` (packed, the
tokenizer's chat template).  The first loss is transformers' own loss of that batch in float64: each
conversation of each packed sample run alone (positions from 0), the cross-entropy over the assistant's
tokens only, a masked mean per micro-batch, averaged over the micro-batches (1e-5: fp32 rounding over
two layers)."""
import importlib.util
import json
import os

import pytest
import torch

from tiny_tokenizer import CHATML, tiny_qwen3, tiny_tokenizer

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, GBS, VOCAB = 128, 4, 512
WORDS = "to be or not that is the question whether nobler in mind suffer slings arrows".split()


def _conversations(path, n=24):
    g = torch.Generator().manual_seed(5)

    def text(k):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))
    with open(path, "w") as fh:
        for i in range(n):
            turns = [{"role": "user", "content": text(2 + i % 3)}, {"role": "assistant", "content": text(3)}]
            if i % 2:
                turns += [{"role": "user", "content": text(2)},
                          {"role": "assistant", "content": text(1 + i % 4)}]
            fh.write(json.dumps({"messages": turns}) + "\n")
    return str(path)


def _convert(argv):
    path = os.path.join(ROOT, "scripts", "convert_hf.py")
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def _expected_first_loss(hf, data, eod):
    """transformers' float64 loss of samples 0 .. GBS-1, one micro-batch of one sample each."""
    tokens, mask = data.get_tokens(range(GBS)), data.get_loss_mask(range(GBS)).double()
    model = hf.double()
    per_row = []
    with torch.no_grad():
        for row, m in zip(tokens, mask):
            total, start = 0.0, 0
            for end in (row == eod).nonzero().flatten().tolist():
                if end > start:  # a conversation: its tokens alone, positions from 0
                    logits = model(row[None, start:end]).logits[0]
                    ce = torch.nn.functional.cross_entropy(logits, row[start + 1:end + 1], reduction="none")
                    total += float((ce * m[start:end]).sum())
                start = end + 1
            per_row.append(total / float(m.sum()))
    hf.float()
    return sum(per_row) / len(per_row)


@pytest.mark.slow  # a conversion and three fine-tuning steps (5 s)
def test_sft_of_a_converted_model_starts_at_the_transformers_loss(tmp_path):
    from megazero.data.sft import SFTData
    from megazero.data.tokenizer import HFTokenizer
    from models.cli import pretrain_main
    tok = tiny_tokenizer(tmp_path / "hf", 400, chat_template=CHATML)
    hf = tiny_qwen3(tmp_path / "hf", VOCAB, tok)
    chats = _conversations(tmp_path / "chats.jsonl")
    assert _convert(["--direction", "to-megazero", "--input", str(tmp_path / "hf"),
                     "--output", str(tmp_path / "ckpt")]) == 0
    metrics = tmp_path / "m.jsonl"
    assert pretrain_main(["--load", str(tmp_path / "ckpt"), "--finetune", "--use-checkpoint-args", "--sft",
                          "--data-path", chats, "--split", "100,0,0", "--reset-attention-mask",
                          "--reset-position-ids", "--seq-length", str(SEQ), "--micro-batch-size", "1",
                          "--global-batch-size", str(GBS), "--train-iters", "3", "--lr", "1e-2",
                          "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
                          "--metrics-file", str(metrics)]) == 0
    rows = [json.loads(line) for line in open(metrics)]
    tokenizer = HFTokenizer(str(tmp_path / "ckpt" / "hf_files"))  # the checkpoint's: the run's tokenizer
    data = SFTData([([chats], "100,0,0", "--data-path")], tokenizer, SEQ, seed=1234)
    ends = [(r == tokenizer.eod).nonzero().flatten().tolist() for r in data.get_tokens(range(GBS))]
    conversations = [sum(1 for a, b in zip([-1] + e, e) if b > a + 1) for e in ends]
    assert data.prompt_format == "default" and max(conversations) >= 2, conversations  # packed
    assert rows[0]["loss"] == pytest.approx(_expected_first_loss(hf, data, tokenizer.eod), abs=1e-5)
    assert rows[2]["loss"] != rows[0]["loss"]
