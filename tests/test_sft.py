"""Supervised fine-tuning data (--sft, megazero/data/sft.py): the loss is on the assistant's tokens only,
conversations are packed several to a sequence and kept apart by the document masks, and a run on the
shipped example (scripts/examples/sft_shakespeare.jsonl) lowers the response loss."""
import json
import os

import pytest
import torch

from megazero.config import validate
from megazero.data.conversations import encode, read_conversations
from megazero.data.sft import SFTData, best_fit_decreasing
from models import build_model
from oracle_models import family_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "scripts", "examples", "sft_shakespeare.jsonl")
SEQ = 64


class ByteTokenizer:
    """Text as its UTF-8 bytes; 256 ends a document (NullTokenizer's id for --vocab-size 256)."""
    eod = 256

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode()


def _conversations(n=23, seed=0):
    """``n`` conversations of varied lengths, both shapes; returns (records, responses)."""
    g = torch.Generator().manual_seed(seed)
    records, responses = [], []
    for i in range(n):
        prompt = f"q{i}:" + "p" * int(torch.randint(1, 12, (), generator=g))
        answer = f"a{i}." + "r" * int(torch.randint(0, 15, (), generator=g))
        if i % 3 == 0:
            records.append({"messages": [{"role": "system", "content": "s"},
                                         {"role": "user", "content": prompt},
                                         {"role": "assistant", "content": answer}]})
        else:
            records.append({"prompt": prompt, "response": answer})
        responses.append(answer)
    return records, responses


def _write(path, records):
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def _segments(row):
    """(start, end) of each document of a sample row: end is the index of its EOD token."""
    out, start = [], 0
    for j, t in enumerate(row.tolist()):
        if t == ByteTokenizer.eod:
            out.append((start, j))
            start = j + 1
    return out


def test_best_fit_decreasing_packs_every_item_once_within_capacity():
    assert best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 10) == [[0, 1, 6], [2, 3, 4, 5]]  # 20 tokens: 2 bins
    lengths = torch.randint(1, 40, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    bins = best_fit_decreasing(lengths, 65)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 65 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 65) + 1  # at most one sequence more than the tokens need


@pytest.mark.parametrize("pack", [True, False])
def test_prompt_tokens_never_carry_loss(tmp_path, pack):
    """Over two epochs of samples: every conversation appears once per epoch; the trained labels of a
    conversation are exactly its response and its EOD; no prompt, system or filler token is a trained
    label.  Packed, sequences hold several conversations; unpacked, one each."""
    records, responses = _conversations()
    data = SFTData([([_write(tmp_path / "c.jsonl", records)], "1,0,0", "--data-path")], ByteTokenizer(), SEQ,
                   pack=pack)
    split = data.splits["train"]
    assert len(split.bins) == (len(records) if not pack else len(split.bins))
    if pack:
        assert len(split.bins) < len(records) / 2 and data.packing() > 0.8
    line = data.summary_lines("train", 2 * len(split.bins))[0]  # the start-up summary's
    assert f"{len(records)} conversations" in line and f"{len(split.bins)} sequences of {SEQ + 1}" in line
    assert "2 epochs" in line and ("packed" if pack else "one per sequence") in line
    for epoch in range(2):
        seen = []
        indices = list(range(epoch * len(split.bins), (epoch + 1) * len(split.bins)))
        tokens, mask = data.get_tokens(indices), data.get_loss_mask(indices)
        assert tokens.shape == (len(indices), SEQ + 1) and mask.shape == (len(indices), SEQ)
        for row, m in zip(tokens, mask):
            segments = _segments(row)
            covered = torch.zeros(SEQ, dtype=torch.bool)
            for start, end in segments:
                if end == start:  # filler: a lone EOD
                    continue
                trained = [j for j in range(start, end) if m[j] == 1]
                text = ByteTokenizer().decode(row[[j + 1 for j in trained if j + 1 < end]])
                assert trained and trained[-1] == end - 1  # the EOD label ends the response
                seen.append(text)
                covered[trained] = True
            assert not m[~covered].any()  # nothing else carries loss
        assert sorted(seen) == sorted(responses)


def _alone_and_packed(model, row, mask):
    """Per-token losses of the packed row and of each conversation alone, and the gradients of the
    masked loss both ways."""
    def run(ids, m):
        model.zero_grad()
        loss = model(ids[None, :-1], labels=ids[None, 1:])[0]
        (loss * m).sum().backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]
    packed, packed_grads = run(row, mask)
    alone_grads = [torch.zeros_like(g) for g in packed_grads]
    pieces = []
    for start, end in _segments(row):
        if end > start:
            loss, grads = run(row[start:end + 1], mask[start:end])
            pieces.append((start, end, loss))
            alone_grads = [a + g for a, g in zip(alone_grads, grads)]
    return packed, packed_grads, pieces, alone_grads


def test_packing_never_lets_a_response_see_another_conversation(tmp_path):
    """float64: with --reset-attention-mask --reset-position-ids, each conversation of a packed SFT
    sample has the per-token losses it has alone, and the masked loss's gradients are the sum of the
    conversations' own (to 1e-12 of the largest); without the masks the later conversations' differ."""
    records, _ = _conversations()
    data = SFTData([([_write(tmp_path / "c.jsonl", records)], "1,0,0", "--data-path")], ByteTokenizer(), SEQ)
    rows = data.get_tokens(range(len(data.splits["train"].bins)))
    k = max(range(len(rows)), key=lambda i: len(_segments(rows[i])))  # the sample of most conversations
    row, mask = rows[k], data.get_loss_mask([k])[0].double()
    assert len(_segments(row)) >= 3
    for masks in (True, False):
        cfg = validate(family_cfg("llama", vocab_size=256, seq_length=SEQ, num_layers=2,
                                  tokenizer_type="NullTokenizer", reset_attention_mask=masks,
                                  reset_position_ids=masks), 1)
        assert cfg.model.vocab_size == 257  # NullTokenizer's end of document: id 256, ByteTokenizer's
        torch.manual_seed(0)
        model = build_model(cfg).double()
        packed, packed_grads, pieces, alone_grads = _alone_and_packed(model, row, mask)
        worst = max(float((packed[s:e] - loss).abs().max()) for s, e, loss in pieces)
        if masks:
            assert worst <= 1e-12 * float(packed.abs().max())
            for a, b in zip(packed_grads, alone_grads):
                assert float((a - b).abs().max()) <= 1e-12 * max(float(b.abs().max()), 1e-300)
        else:
            assert worst > 1e-3  # the control: without the masks the conversations see each other


@pytest.mark.slow  # trains a tokenizer
def test_the_chat_template_trains_the_answer_and_not_the_header(tmp_path):
    from megazero.data.tokenizer import HFTokenizer
    from tiny_tokenizer import CHATML, tiny_tokenizer
    tiny_tokenizer(tmp_path / "tok", chat_template=CHATML)
    tok = HFTokenizer(str(tmp_path / "tok"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "To be, or not"},
                {"role": "assistant", "content": "to be"}, {"role": "user", "content": "that is"},
                {"role": "assistant", "content": "the question"}]
    ids, trained = encode(messages, tok, "default", tok.eod)
    assert ids[-1] == tok.eod and trained[-1]
    assert tok.decode([i for i, t in zip(ids, trained) if t]) == \
        "to be<|im_end|>the question<|im_end|><|endoftext|>"  # (jinja trims the newline after a block)
    assert tok.decode(ids).startswith("<|im_start|>system\nbe brief<|im_end|><|im_start|>user\n")
    tok.tok.chat_template = "{% for m in messages[-1:] %}{{ m['content'] }}{% endfor %}"  # not prefixes
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        encode(messages, tok, "default", tok.eod)
    tok.tok.chat_template = "{{ raise_exception('System role not supported') }}"  # Gemma's, say
    with pytest.raises(ValueError, match="template refused the conversation .*System role not supported"):
        encode(messages, tok, "default", tok.eod)


def test_an_eod_inside_a_conversation_is_refused_where_documents_are_found(tmp_path):
    class HashEnds(ByteTokenizer):
        eod = ord("#")
    path = _write(tmp_path / "c.jsonl", [{"prompt": "p", "response": "r"},
                                         {"prompt": "a # b", "response": "c"}])
    with pytest.raises(ValueError, match=r"c.jsonl:2: the end-of-document id 35 occurs inside the conv"):
        SFTData([([path], "1,0,0", "--data-path")], HashEnds(), SEQ)
    with pytest.raises(ValueError, match="occurs inside"):  # --reset-position-ids alone finds documents too
        SFTData([([path], "1,0,0", "--data-path")], HashEnds(), SEQ, pack=False, documents=True)
    data = SFTData([([path], "1,0,0", "--data-path")], HashEnds(), SEQ, pack=False)  # causal only: fine
    assert len(data.splits["train"].bins) == 2


def test_both_shapes_read_as_turns(tmp_path):
    path = _write(tmp_path / "c.jsonl", [
        {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"system": "s", "prompt": "p", "response": "r"}])
    (one, first), (two, second) = read_conversations(path)
    assert (one, two) == (1, 2) and [m["role"] for m in first] == ["user", "assistant"]
    assert second == [{"role": "system", "content": "s"}, {"role": "user", "content": "p"},
                      {"role": "assistant", "content": "r"}]
    ids, trained = encode(second, ByteTokenizer(), "identity", ByteTokenizer.eod)
    assert ids == list(b"spr") + [256] and trained == [False, False, True, True]


def test_the_shipped_example_reads(tmp_path):
    conversations = read_conversations(EXAMPLE)
    assert len(conversations) >= 50
    assert all(m[-1]["role"] == "assistant" for _, m in conversations)


def _sp_tokenizer(tmp_path):
    import sentencepiece as spm
    spm.SentencePieceTrainer.Train(input=EXAMPLE, model_prefix=str(tmp_path / "tok"), vocab_size=300,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=3,
                                   user_defined_symbols=["\n"], minloglevel=2, num_threads=1)
    return str(tmp_path / "tok.model")


def _pretrain(argv):
    from models.cli import pretrain_main
    return pretrain_main(argv)


SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3",
         "--lr-decay-style", "constant", "--log-interval", "100", "--split", "100,0,0"]


@pytest.mark.slow  # 30 training steps
def test_sft_on_the_shipped_example_lowers_the_response_loss(tmp_path):
    tok = _sp_tokenizer(tmp_path)
    metrics = tmp_path / "m.jsonl"
    argv = ["--sft", "--data-path", EXAMPLE, "--tokenizer-model", tok, "--reset-attention-mask",
            "--reset-position-ids", "--train-iters", "30", "--metrics-file", str(metrics), *SMALL]
    assert _pretrain(argv) == 0
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert len(losses) == 30 and last < first - 1.0, (first, last)


@pytest.mark.parametrize("why,argv,words", [
    ("mock data", ["--mock-data"], "--sft reads conversations"),
    ("no tokenizer", ["--data-path", EXAMPLE, "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"],
     "--sft encodes the conversations' text"),
    ("nemotron", ["--data-path", EXAMPLE, "--sft-tokenizer-prompt-format", "nemotron-h-aligned", "TOK"],
     "Nemotron's prompt formats are not implemented"),
    ("weights", ["--data-path", "1.0", EXAMPLE, "TOK"], "without weights"),
    ("too long", ["--data-path", EXAMPLE, "--seq-length", "8", "TOK"], "longer than a sequence"),
    ("empty valid split", ["--data-path", EXAMPLE, "--split", "100,0,0", "--eval-interval", "2", "TOK"],
     "the valid split holds no conversation"),
    ("bad line", ["--data-path", "BAD", "TOK"], "BAD_FILE:2: a conversation is"),
    ("not UTF-8", ["--data-path", "LATIN", "TOK"], "LATIN_FILE:1: not UTF-8 text"),
])
def test_bad_sft_input_is_one_line_and_exit_2(tmp_path, capfd, why, argv, words):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"question": "a"}\n')
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "café", "response": "b"}\n'.encode("latin-1"))
    tok = _sp_tokenizer(tmp_path) if "TOK" in argv else None
    argv = [{"TOK": "--tokenizer-model", "BAD": str(bad), "LATIN": str(latin)}.get(a, a) for a in argv]
    if tok:
        argv.append(tok)
    base = ["--sft", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--micro-batch-size", "1", "--train-iters", "1"]
    capfd.readouterr()
    assert _pretrain(base + argv) == 2, why
    err = capfd.readouterr().err.strip().splitlines()
    words = words.replace("BAD_FILE", str(bad)).replace("LATIN_FILE", str(latin))
    assert len(err) == 1 and words in err[0], err


@pytest.mark.slow  # trains a tokenizer
def test_megatrons_sft_tokenizer_type_is_a_hugging_face_directory(tmp_path):
    """Megatron-LM's SFT scripts pass --tokenizer-type SFTTokenizer: a Hugging Face directory here, whose
    chat template --sft uses by default."""
    from megazero.config import parse_args
    from megazero.data import build_data
    from tiny_tokenizer import CHATML, tiny_tokenizer
    tiny_tokenizer(tmp_path / "tok", chat_template=CHATML)
    cfg = parse_args(["--sft", "--data-path", EXAMPLE, "--tokenizer-type", "SFTTokenizer",
                      "--tokenizer-model", str(tmp_path / "tok"), "--split", "100,0,0", "--seq-length", "256",
                      "--reset-attention-mask", "--num-layers", "1", "--hidden-size", "16",
                      "--num-attention-heads", "2"], world_size=1)
    data = build_data(cfg)
    assert cfg.model.vocab_size == 400 and data.prompt_format == "default"
    assert len(data.splits["train"].bins) < 60 / 2


def _train_losses(argv):
    from megazero.config import parse_args
    from megazero.training import train
    import models
    return [m["loss"] for m in train(parse_args(argv), models.build_chunks)]


LAYOUTS = {"dp2-pp2": ["--pipeline-model-parallel-size", "2"],
           "cp2-tp2": ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"]}


@pytest.mark.slow  # 1 and 4 ranks
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sft_under_a_layout_equals_one_process(tmp_path, layout):
    """The loss mask reaches the last pipeline stage, each data-parallel rank's share and each context-
    parallel rank's chunk (packed conversations crossing the chunk boundary): 4 ranks give one process's
    losses (fp32 SGD: R_TRAIN)."""
    from megazero.process.local_ranks import run_ranks
    from tolerance import R_TRAIN
    tok = _sp_tokenizer(tmp_path)
    argv = ["--sft", "--data-path", EXAMPLE, "--tokenizer-model", tok, "--reset-attention-mask",
            "--reset-position-ids", "--train-iters", "4", "--optimizer", "sgd", "--lr", "0.1", *SMALL]
    argv[argv.index("--num-layers") + 1] = "4"
    (one,) = run_ranks(_train_losses, 1, argv)
    four = run_ranks(_train_losses, 4, argv + LAYOUTS[layout])
    assert len(one) == 4 and four[-1] == pytest.approx(one, rel=R_TRAIN)
    assert one[-1] < one[0]


def test_separate_train_and_valid_files(tmp_path):
    """--train-data-path / --valid-data-path: each file is its split, whole."""
    from megazero.config import parse_args
    from megazero.data import build_data
    records, _ = _conversations(9)
    valid = _write(tmp_path / "valid.jsonl", records[:4])
    cfg = parse_args(["--sft", "--train-data-path", EXAMPLE, "--valid-data-path", valid, "--tokenizer-model",
                      _sp_tokenizer(tmp_path), "--eval-interval", "2", "--eval-iters", "1",
                      "--seq-length", "128", "--num-layers", "1", "--hidden-size", "16",
                      "--num-attention-heads", "2"], world_size=1)
    data = build_data(cfg)
    counts = {k: len(s.offsets) - 1 for k, s in data.splits.items()}
    assert counts == {"train": 60, "valid": 4} and data.files["valid"] == [valid]
    assert data.get_tokens([0], "valid").shape == (1, 129)
    assert float(data.get_loss_mask([0], "valid").sum()) > 0
