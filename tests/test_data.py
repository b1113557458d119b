"""Real data: Megatron's indexed format, tokenizer, preprocess_data.py, GPT samples, training on it.

Everything is built in temporary directories from generated text (no network)."""
import importlib.util
import json
import math
import os
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from megazero.config import ConfigError, config_from_dict, validate
from megazero.data import build_data, micro_batches
from megazero.data.gpt_dataset import BlendedGPTData, GPTDataset, parse_data_path, parse_split, split_bounds
from megazero.data import preprocess
from models.cli import preprocess as preprocess_cli
from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype, write_index
from megazero.data.tokenizer import SentencePieceTokenizer, load_tokenizer
from tolerance import R_TRAIN_ADAM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the king queen sword love night day crown fool death sleep dream heart blood honour lord lady "
         "ghost storm sea speak thou art hath doth good sweet fair").split()


def _script(name):
    path = os.path.join(ROOT, "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _paragraph(rng):
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize() + "."
             for _ in range(rng.randint(1, 4))]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A ~60 KB generated corpus, a 256-piece BPE model, and its preprocessed txt and JSONL datasets."""
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    paragraphs = [_paragraph(rng) for _ in range(600)]
    (d / "a.txt").write_text("\n\n".join(paragraphs[:400]) + "\n")
    (d / "b.txt").write_text("\n\n  \n".join(paragraphs[400:]))
    with open(d / "c.jsonl", "w") as fh:
        for i, p in enumerate(paragraphs[:150]):
            fh.write(json.dumps({"text": p, "title": f"lord {WORDS[i % len(WORDS)]}"}) + "\n")
    assert _script("train_tokenizer").main(["--input", str(d / "a.txt"), str(d / "b.txt"),
                                            "--vocab-size", "256",
                                            "--model-prefix", str(d / "tok"), "--num-threads", "1"]) == 0
    tok = str(d / "tok.model")
    assert preprocess_cli.main(["--input", str(d / "a.txt"), str(d / "b.txt"),
                                "--output-prefix", str(d / "txt"),
                                "--tokenizer-model", tok, "--append-eod"]) == 0
    assert preprocess_cli.main(["--input", str(d / "c.jsonl"), "--output-prefix", str(d / "js"),
                                "--json-keys", "text", "title",
                                "--tokenizer-model", tok, "--append-eod", "--workers", "2"]) == 0
    return {"dir": d, "tok": tok, "paragraphs": paragraphs, "txt": str(d / "txt_text_document"),
            "js": str(d / "js_text_document"), "title": str(d / "js_title_document")}


# ---- the indexed format ---------------------------------------------------------------------
def _fixture_bytes():
    """The .idx of documents [5, 6, 7] and [8, 9] in uint16, laid out byte by byte."""
    idx = b"MMIDIDX\x00\x00"                    # magic
    idx += (1).to_bytes(8, "little")              # version
    idx += bytes([8])                             # dtype code 8 = uint16
    idx += (2).to_bytes(8, "little")              # 2 sequences
    idx += (3).to_bytes(8, "little")              # document index of length 3
    idx += (3).to_bytes(4, "little") + (2).to_bytes(4, "little")  # int32 lengths
    idx += (0).to_bytes(8, "little") + (6).to_bytes(8, "little")  # int64 byte pointers
    idx += b"".join(i.to_bytes(8, "little") for i in (0, 1, 2))   # int64 document index
    bin_ = b"".join(i.to_bytes(2, "little") for i in (5, 6, 7, 8, 9))
    return idx, bin_


def test_writer_produces_the_megatron_header_byte_for_byte(tmp_path):
    idx, bin_ = _fixture_bytes()
    assert len(idx) == 34 + 2 * 12 + 3 * 8
    with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as w:
        w.add_document([5, 6, 7])
        w.add_document(np.array([8, 9]))
    assert (tmp_path / "w.idx").read_bytes() == idx
    assert (tmp_path / "w.bin").read_bytes() == bin_


def test_reader_reads_the_hand_built_fixture(tmp_path):
    idx, bin_ = _fixture_bytes()
    (tmp_path / "f.idx").write_bytes(idx)
    (tmp_path / "f.bin").write_bytes(bin_)
    ds = IndexedDataset(str(tmp_path / "f"))
    assert ds.dtype == np.uint16 and len(ds) == 2 and ds.num_documents == 2 and ds.num_tokens == 5
    assert ds[0].tolist() == [5, 6, 7] and ds[1].tolist() == [8, 9]
    assert ds.get(0, 1, 2).tolist() == [6, 7] and ds.document(1).tolist() == [8, 9]
    assert ds.sequence_pointers.tolist() == [0, 6] and ds.document_indices.tolist() == [0, 1, 2]
    # Megatron's multimodal files append an int8 mode per sequence: still readable
    (tmp_path / "f.idx").write_bytes(idx + b"\x00\x00")
    assert IndexedDataset(str(tmp_path / "f"))[1].tolist() == [8, 9]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_round_trip_with_sentences_empty_documents_and_merge(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=n) for n in (5, 0, 1, 17, 3)]
    with IndexedDatasetWriter(str(tmp_path / "a"), dtype) as w:
        for doc in docs:
            w.add_document(doc, lengths=[len(doc)] if len(doc) else [])
        w.add_item([1, 2])  # a document of two sentences
        w.add_item([3])
        w.end_document()
    ds = IndexedDataset(str(tmp_path / "a"))
    assert ds.num_documents == 6 and len(ds) == 6  # the empty document holds no sequence
    for k, doc in enumerate(docs):
        assert ds.document(k).tolist() == doc.tolist()
    assert ds.document(5).tolist() == [1, 2, 3] and ds[5].tolist() == [3]
    with IndexedDatasetWriter(str(tmp_path / "m"), dtype) as w:
        w.add_index(str(tmp_path / "a"))
        w.add_index(str(tmp_path / "a"))
    m = IndexedDataset(str(tmp_path / "m"))
    assert m.num_documents == 12 and m.document(11).tolist() == [1, 2, 3]
    assert m.document(9).tolist() == docs[3].tolist()
    assert best_dtype(32000) == np.uint16 and best_dtype(128256) == np.int32


def test_reader_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope.idx")):
        IndexedDataset(str(tmp_path / "nope"))
    idx, bin_ = _fixture_bytes()
    (tmp_path / "f.bin").write_bytes(bin_)
    for bad, msg in ((b"XXIDIDX\x00\x00" + idx[9:], "magic"),
                     (idx[:9] + (2).to_bytes(8, "little") + idx[17:], "version"), (idx[:40], "truncated")):
        (tmp_path / "f.idx").write_bytes(bad)
        with pytest.raises(ValueError, match=msg):
            IndexedDataset(str(tmp_path / "f"))
    (tmp_path / "f.idx").write_bytes(idx)
    (tmp_path / "f.bin").write_bytes(bin_[:-2])
    with pytest.raises(ValueError, match="f.bin"):
        IndexedDataset(str(tmp_path / "f"))
    with pytest.raises(ValueError, match="fit"):
        IndexedDatasetWriter(str(tmp_path / "g"), np.uint16).add_document([70000])
    with pytest.raises(ValueError, match="document indices"):
        write_index(str(tmp_path / "h.idx"), np.int32, [1, 2], [0, 1])


def _corrupt(tmp_path, name, lengths=None, pointers=None, docs=None, n_doc=None):
    """A valid dataset (uint16 documents of 3+2 and 4 tokens), then its index arrays overwritten."""
    prefix = str(tmp_path / name)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_item([1, 2, 3])
        w.add_item([4, 5])
        w.end_document()
        w.add_document([6, 7, 8, 9])
    raw = bytearray((tmp_path / f"{name}.idx").read_bytes())
    n_seq = 3
    if lengths is not None:
        raw[34:34 + 4 * n_seq] = np.asarray(lengths, "<i4").tobytes()
    if pointers is not None:
        raw[34 + 4 * n_seq:34 + 12 * n_seq] = np.asarray(pointers, "<i8").tobytes()
    if docs is not None:
        if n_doc is not None:
            raw[26:34] = struct.pack("<Q", n_doc)
        raw[34 + 12 * n_seq:] = np.asarray(docs, "<i8").tobytes()
    (tmp_path / f"{name}.idx").write_bytes(bytes(raw))
    return prefix


@pytest.mark.parametrize("corruption, msg", [
    (dict(pointers=[0, 6, 10 ** 9]), "sequence 2 points at byte 1000000000.*byte 10"),
    (dict(pointers=[2, 6, 10]), "sequence 0 points at byte 2"),
    (dict(lengths=[2, 3, 4]), "sequence 1 points at byte 6.*byte 4"),  # same total, wrong split
    (dict(lengths=[3, -2, 8]), "sequence 1 has length -2"),
    (dict(docs=[0, 2, 5]), "runs from 0 to 5.*sequence count 3"),
    (dict(docs=[1, 2, 3]), "runs from 1 to 3"),
    (dict(docs=[0, 2, 1, 3], n_doc=4), "document 1 ends at sequence 1, before it starts at sequence 2"),
    (dict(docs=[], n_doc=0), "document index is empty"),
])
def test_reader_rejects_a_corrupted_index_at_open(tmp_path, corruption, msg):
    assert IndexedDataset(_corrupt(tmp_path, "ok")).document(0).tolist() == [1, 2, 3, 4, 5]
    prefix = _corrupt(tmp_path, "bad", **corruption)
    with pytest.raises(ValueError, match=r"bad\.idx: corrupted index: .*" + msg):
        IndexedDataset(prefix)
    with pytest.raises(ConfigError, match="--data-path.*bad.idx"):
        build_data(validate(_data_cfg([prefix])))


def test_reader_checks_large_indices_in_chunks(tmp_path, monkeypatch):
    from megazero.data import indexed
    prefix = str(tmp_path / "big")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for _ in range(50):
            w.add_document(rng.integers(0, 9, size=int(rng.integers(1, 5))))
    monkeypatch.setattr(indexed, "_CHECK_CHUNK", 7)
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 50 and ds.num_tokens == int(ds.sequence_lengths.sum())
    raw = bytearray((tmp_path / "big.idx").read_bytes())
    lengths = ds.sequence_lengths.copy()
    del ds
    lengths[23], lengths[24] = lengths[23] + 1, lengths[24] - 1
    raw[34:34 + 4 * 50] = lengths.astype("<i4").tobytes()
    (tmp_path / "big.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sequence 24 points"):
        IndexedDataset(prefix)


def test_writer_leaves_an_existing_dataset_until_finalize(tmp_path):
    prefix = str(tmp_path / "d")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
    old = {ext: (tmp_path / f"d{ext}").read_bytes() for ext in (".bin", ".idx")}
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([4, 5, 6, 7])
            assert IndexedDataset(prefix).document(0).tolist() == [1, 2, 3]  # still the old one
            raise RuntimeError("input failed")
    assert {ext: (tmp_path / f"d{ext}").read_bytes() for ext in (".bin", ".idx")} == old
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporary files left
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([4, 5, 6, 7])
    assert IndexedDataset(prefix).document(0).tolist() == [4, 5, 6, 7]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


# ---- tokenizer and preprocessing ----------------------------------------------------------
def test_sentencepiece_tokenizer(corpus, tmp_path):
    tok = load_tokenizer(corpus["tok"])
    assert isinstance(tok, SentencePieceTokenizer) and tok.vocab_size == 256
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id, tok.eod) == (0, 1, 2, 3, 2)
    text = "The king doth sleep. Sweet lady speak."
    ids = tok.encode(text)
    assert ids and max(ids) < 256 and tok.decode(ids) == text
    import pickle
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids
    with pytest.raises(FileNotFoundError, match="missing.model"):
        load_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model"):
        load_tokenizer(str(tmp_path / "junk.model"))


def test_preprocess_txt_one_document_per_paragraph(corpus):
    tok = load_tokenizer(corpus["tok"])
    ds = IndexedDataset(corpus["txt"])
    paragraphs = corpus["paragraphs"]
    assert ds.num_documents == len(paragraphs) == len(ds) and ds.dtype == np.uint16
    for k in (0, 1, 399, 400, 599):
        ids = ds.document(k).tolist()
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == " ".join(paragraphs[k].split())  # nmt_nfkc folds newlines


def test_preprocess_jsonl_keys_and_workers_agree(corpus, tmp_path):
    ds, titles = IndexedDataset(corpus["js"]), IndexedDataset(corpus["title"])
    assert ds.num_documents == titles.num_documents == 150
    txt = IndexedDataset(corpus["txt"])
    assert all(ds.document(k).tolist() == txt.document(k).tolist() for k in range(150))
    tok = load_tokenizer(corpus["tok"])
    assert tok.decode(titles.document(7).tolist()[:-1]) == f"lord {WORDS[7]}"
    out = str(tmp_path / "one")
    assert preprocess_cli.main(["--input", str(corpus["dir"] / "c.jsonl"), "--output-prefix", out,
                                "--tokenizer-model", corpus["tok"], "--append-eod"]) == 0
    for ext in (".bin", ".idx"):
        with open(out + "_text_document" + ext, "rb") as a, open(corpus["js"] + ext, "rb") as b:
            assert a.read() == b.read()


def test_preprocess_file_documents_and_errors(corpus, tmp_path, capsys):
    out = str(tmp_path / "f")
    assert preprocess_cli.main(["--input", str(corpus["dir"] / "a.txt"), str(corpus["dir"] / "b.txt"),
                                "--output-prefix", out,
                                "--tokenizer-model", corpus["tok"], "--text-document", "file"]) == 0
    ds = IndexedDataset(out + "_text_document")
    assert ds.num_documents == 2 and load_tokenizer(corpus["tok"]).eod not in ds.document(0).tolist()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"body": "b"}\n')
    assert preprocess_cli.main(["--input", str(bad), "--output-prefix", out,
                                "--tokenizer-model", corpus["tok"]]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert preprocess_cli.main(["--input", str(bad), "--output-prefix", out,
                                "--tokenizer-model", str(tmp_path / "x.model")]) == 2
    assert "x.model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preprocess_cli.main(["--input", str(tmp_path / "absent.txt"), "--output-prefix", out,
                             "--tokenizer-model", corpus["tok"]])
    assert "absent.txt" in capsys.readouterr().err


def test_failed_preprocess_keeps_the_existing_dataset(corpus, tmp_path, capsys):
    out = str(tmp_path / "keep")
    args = ["--output-prefix", out, "--tokenizer-model", corpus["tok"], "--append-eod"]
    assert preprocess_cli.main(["--input", str(corpus["dir"] / "c.jsonl")] + args) == 0
    files = {ext: open(out + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    assert preprocess_cli.main(["--input", str(bad)] + args) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert {ext: open(out + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")} == files
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "keep_text_document.bin", "keep_text_document.idx"]


def test_preprocess_refuses_empty_input(corpus, tmp_path, capsys):
    out = str(tmp_path / "e")
    for name, text in (("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.jsonl", "\n")):
        (tmp_path / name).write_text(text)
        assert preprocess_cli.main(["--input", str(tmp_path / name), "--output-prefix", out,
                                    "--tokenizer-model", corpus["tok"]]) == 2
        err = capsys.readouterr().err
        assert f"--input {tmp_path / name}: no documents" in err, err
    (tmp_path / "void.jsonl").write_text('{"text": ""}\n')
    assert preprocess_cli.main(["--input", str(tmp_path / "void.jsonl"), "--output-prefix", out,
                                "--tokenizer-model", corpus["tok"], "--append-eod"]) == 2
    assert "1 documents but no tokens" in capsys.readouterr().err
    assert not any(f.startswith("e_") for f in os.listdir(tmp_path))


def test_preprocess_worker_pool_matches_one_process(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess, "BATCH_BYTES", 2000)  # the 60 KB corpus then uses the pool
    base = ["--input", str(corpus["dir"] / "a.txt"), str(corpus["dir"] / "b.txt"),
            "--tokenizer-model", corpus["tok"], "--append-eod"]
    assert preprocess_cli.main(base + ["--output-prefix", str(tmp_path / "w2"), "--workers", "2"]) == 0
    for ext in (".bin", ".idx"):
        with open(str(tmp_path / "w2_text_document") + ext, "rb") as a, open(corpus["txt"] + ext, "rb") as b:
            assert a.read() == b.read()
    assert len(list(preprocess.batches(((0, {"text": "x" * 300}) for _ in range(20)), 1000, 3))) == 7
    # two partitions: each keeps its own lists, in its documents' order
    docs = preprocess.partitioned(({"text": str(i)} for i in range(7)), 2)
    got = [(p, [d["text"] for d in b]) for p, b in preprocess.batches(docs, 1000, 3)]
    assert got == [(0, ["0", "2", "4"]), (1, ["1", "3", "5"]), (0, ["6"])]


def test_preprocess_script_runs_standalone(corpus, tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "preprocess_data.py"), "--input",
                          str(corpus["dir"] / "c.jsonl"), "--output-prefix", str(tmp_path / "s"),
                          "--tokenizer-model", corpus["tok"], "--append-eod", "--workers", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "150 documents" in out.stdout
    assert IndexedDataset(str(tmp_path / "s_text_document")).num_documents == 150


# ---- GPT samples -----------------------------------------------------------------------------
def _numbered(tmp_path, name, n_docs, base=0, seed=0):
    """Document k holds only the token base + k (lengths vary): a token names its document."""
    rng = np.random.default_rng(seed)
    prefix = str(tmp_path / name)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for k in range(n_docs):
            w.add_document(np.full(int(rng.integers(1, 30)), base + k))
    return prefix


def test_split_and_data_path_parsing():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_bounds(1000, parse_split("969,30,1")) == [0, 969, 999, 1000]
    assert split_bounds(10, parse_split("1,1,1"))[-1] == 10
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert parse_data_path(["x"]) == [(1.0, "x")]
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == [(pytest.approx(0.7), "a"), (pytest.approx(0.3), "b")]
    assert parse_data_path(["3", "a", "1", "b"])[0][0] == pytest.approx(0.75)
    assert parse_data_path(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    with pytest.raises(ValueError, match="pairs"):
        parse_data_path(["0.7", "a", "0.3"])


def test_samples_are_windows_of_the_shuffled_document_stream(tmp_path):
    prefix = _numbered(tmp_path, "n", 200)
    ds = GPTDataset(prefix, seq_length=8, split="80,10,10", seed=5)
    stream = ds.stream("train")
    seqs, _, _, order = stream._epoch(0)
    assert sorted(seqs.tolist()) == list(range(160))  # each training document once per epoch
    tokens = np.concatenate([ds.indexed[int(s)] for s in seqs])
    n = stream.samples_per_epoch
    assert n == (len(tokens) - 1) // 8
    for i in (0, 1, n - 1):
        j = int(order[i])
        assert ds.sample(i).tolist() == tokens[j * 8:j * 8 + 9].tolist()
    assert sorted(order.tolist()) == list(range(n))
    # later epochs reshuffle; the sample stays a pure function of (seed, split, index)
    again = GPTDataset(prefix, seq_length=8, split="80,10,10", seed=5)
    assert again.sample(n + 3).tolist() == ds.sample(n + 3).tolist()
    assert not np.array_equal(ds.stream("train")._epoch(1)[0], seqs)
    other = GPTDataset(prefix, seq_length=8, split="80,10,10", seed=6)
    assert [other.sample(i).tolist() for i in range(4)] != [ds.sample(i).tolist() for i in range(4)]


def test_documents_of_several_sentences_stay_together(tmp_path):
    prefix = str(tmp_path / "s")
    rng = np.random.default_rng(2)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for k in range(60):  # document k: sentences 1000 * k + s, each of a few tokens
            for s in range(int(rng.integers(1, 6))):
                w.add_item(np.full(int(rng.integers(1, 4)), 1000 * k + s))
            w.end_document()
    ds = GPTDataset(prefix, seq_length=8, split="1,0,0", seed=4)
    di = ds.indexed.document_indices
    for e in (0, 1):
        seqs = ds.stream("train")._epoch(e)[0]
        assert sorted(seqs.tolist()) == list(range(len(ds.indexed)))
        doc_of = np.searchsorted(di, seqs, side="right") - 1
        runs = np.flatnonzero(np.diff(doc_of)) + 1
        starts = np.concatenate([[0], runs])
        assert len(starts) == 60 and not np.array_equal(doc_of[starts], np.arange(60))  # shuffled...
        for a, b in zip(starts, np.concatenate([runs, [len(seqs)]])):
            assert seqs[a:b].tolist() == list(range(di[doc_of[a]], di[doc_of[a] + 1]))  # ...whole, in order
    # so the token stream (the samples, unshuffled) shows every document's sentences in order
    stream = ds.stream("train")
    order = stream._epoch(0)[3]
    tokens = np.empty(stream.samples_per_epoch * 8 + 1, dtype=np.int64)
    for i in range(stream.samples_per_epoch):
        tokens[int(order[i]) * 8:int(order[i]) * 8 + 9] = ds.sample(i)
    sentence = tokens % 1000
    changes = np.flatnonzero(np.diff(tokens)) + 1
    same_doc = (tokens[changes] // 1000) == (tokens[changes - 1] // 1000)
    assert np.all(sentence[changes][same_doc] == sentence[changes - 1][same_doc] + 1)
    assert np.all(sentence[changes][~same_doc] == 0)


def test_splits_are_disjoint_by_document(tmp_path):
    prefix = _numbered(tmp_path, "n", 100)
    src = BlendedGPTData([prefix], seq_length=4, split="70,20,10", seed=1)
    seen = {s: set(src.get_tokens(range(300), s).flatten().tolist()) for s in ("train", "valid", "test")}
    assert seen["train"] <= set(range(70)) and len(seen["train"]) > 60
    assert seen["valid"] <= set(range(70, 90)) and seen["test"] <= set(range(90, 100))
    with pytest.raises(ValueError, match="valid split"):
        BlendedGPTData([prefix], seq_length=4, split="100,0,0").get_tokens([0], "valid")


@pytest.mark.parametrize("dp,mbs", [(2, 1), (4, 2), (8, 1)])
def test_every_layout_sees_the_same_global_samples(tmp_path, dp, mbs):
    prefix = _numbered(tmp_path, "n", 300)
    gbs = 16
    for step in (0, 5):
        one = micro_batches(BlendedGPTData([prefix], 12), step, gbs, 4, 0, 1)
        single = torch.cat([b["tokens"] for b in one])
        # each rank builds its own source, as training does, and asks only for its share
        parts = [b for d in range(dp)
                 for b in micro_batches(BlendedGPTData([prefix], 12), step, gbs, mbs, d, dp)]
        assert all(b["tokens"].shape == (mbs, 12) and bool((b["loss_mask"] == 1).all()) for b in parts)
        assert torch.equal(torch.cat([b["tokens"] for b in parts]), single)
        assert torch.equal(parts[0]["labels"][:, :-1], parts[0]["tokens"][:, 1:])


def test_blending_follows_the_weights_and_is_prefix_stable(tmp_path):
    a, b = _numbered(tmp_path, "a", 120, base=0), _numbered(tmp_path, "b", 120, base=1000, seed=1)
    src = BlendedGPTData(["0.7", a, "0.3", b], seq_length=4, split="1,0,0", seed=3)
    rows = src.get_tokens(range(2000))
    from_b = (rows[:, 0] >= 1000).numpy()
    for n in (10, 100, 2000):
        assert abs(int(from_b[:n].sum()) - 0.3 * n) <= 1
    fresh = BlendedGPTData(["0.7", a, "0.3", b], seq_length=4, split="1,0,0", seed=3)
    assert torch.equal(fresh.get_tokens([1999, 5, 1500]), rows[[1999, 5, 1500]])
    # a blended dataset's samples are that dataset's own samples, in order
    only_a = GPTDataset(a, 4, "1,0,0", 3)
    picks = np.flatnonzero(~from_b)[:5]
    assert [rows[i].tolist() for i in picks] == [only_a.sample(k).tolist() for k in range(5)]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1 / 3] * 3, [0.5, 0.0, 0.3, 0.2], [0.9, 0.05, 0.05],
                                     (np.random.default_rng(1).dirichlet(np.ones(12))).tolist()])
def test_blend_index_is_the_greedy_rule_built_at_once_or_in_steps(weights, monkeypatch):
    from megazero.data.gpt_dataset import _BlendIndex, _greedy_steps
    monkeypatch.setattr(_BlendIndex, "CHUNK", 4096)
    monkeypatch.setattr(_BlendIndex, "BLOCK", 512)
    weights = [w / sum(weights) for w in weights]
    n = 30000
    ref = _greedy_steps(weights, [0] * len(weights), 0, n)
    ref_local = np.empty(n, dtype=np.int64)
    for d in range(len(weights)):
        ref_local[ref == d] = np.arange(int((ref == d).sum()))
    at_once, steps = _BlendIndex(weights), _BlendIndex(weights)
    at_once.extend(n)
    for upto in (1, 5000, 5001, 12000, n):
        steps.extend(upto)
    assert np.array_equal(at_once.which[:n], ref) and np.array_equal(steps.which[:n], ref)
    picks = [0, 1, 511, 512, 4095, 4096, 4097, 29999] + list(range(12000, 12100))
    for blend in (at_once, steps):
        which, local = blend.lookup(picks)
        assert which.tolist() == ref[picks].tolist() and local.tolist() == ref_local[picks].tolist()


# ---- configuration and errors ----------------------------------------------------------------
def _data_cfg(data_path, **extra):
    settings = dict(data_path=list(data_path), num_layers=2, hidden_size=32, num_attention_heads=4,
                    seq_length=16, vocab_size=256, global_batch_size=8, micro_batch_size=2, train_iters=8,
                    eval_interval=0, eval_iters=1, optimizer="adam", lr=1e-2, lr_warmup_iters=0,
                    log_interval=100, split="90,10,0", hidden_dropout=0.0, attention_dropout=0.0)
    return config_from_dict(dict(settings, **extra))


def test_build_data_errors_name_the_problem(corpus, tmp_path):
    missing = str(tmp_path / "nowhere" / "x_text_document")
    with pytest.raises(ConfigError, match="--data-path.*" + missing.replace("/", ".") + r"\.idx"):
        build_data(validate(_data_cfg([missing])))
    with pytest.raises(ConfigError, match="--data-path"):
        build_data(validate(_data_cfg(["0.5", corpus["txt"], "0.5"])))
    with pytest.raises(ConfigError, match="valid split"):
        build_data(validate(_data_cfg([corpus["txt"]], split="100,0,0", eval_interval=2)))
    with pytest.raises(ConfigError, match="token id .* is outside --vocab-size 50"):  # at start-up
        build_data(validate(_data_cfg([corpus["txt"]], vocab_size=50)))
    from megazero.data.gpt_dataset import BlendedGPTData
    small = BlendedGPTData([corpus["txt"]], 16, "90,10,0", vocab_size=50)
    with pytest.raises(ValueError, match="--vocab-size 50"):  # and per batch, for data not scanned
        small.get_tokens(range(8))
    with pytest.raises(ConfigError, match="--tokenizer-model.*absent.model"):
        validate(_data_cfg([corpus["txt"]], tokenizer_model=str(tmp_path / "absent.model")))


def test_tokenizer_model_sets_the_vocabulary(corpus):
    """As in Megatron-LM the tokenizer sets the vocabulary; a --vocab-size that differs is named in a
    start-up warning with both numbers (nothing when it agrees)."""
    cfg = validate(_data_cfg([corpus["txt"]], vocab_size=50, tokenizer_model=corpus["tok"]))
    assert cfg.model.vocab_size == 256 and cfg.model.padded_vocab_size == 256
    assert f"WARNING: --vocab-size 50 ignored: the tokenizer ({corpus['tok']}) has 256 ids and sets the " \
        "model's vocabulary, as in Megatron-LM" in " ".join(cfg.notes)
    assert not [n for n in _data_cfg([corpus["txt"]], tokenizer_model=corpus["tok"]).notes if "vocab" in n]
    validate(cfg)  # re-validation keeps it
    assert cfg.model.vocab_size == 256
    assert build_data(cfg).get_tokens(range(4)).shape == (4, 17)


def test_pretrain_cli_reports_a_missing_prefix(tmp_path, monkeypatch, capsys):
    from models.cli.pretrain import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    missing = str(tmp_path / "gone_text_document")
    argv = ["--data-path", missing, "--vocab-size", "256", "--train-iters", "1"]
    assert main(argv, lambda cfg, mesh: None) == 2
    assert missing + ".idx" in capsys.readouterr().err


# ---- training on it ---------------------------------------------------------------------------
def _train_history(cfg):
    import models
    from megazero.training import train
    return train(cfg, models.build_chunks)


def test_training_on_preprocessed_text_one_process_and_dp2(corpus):
    from megazero.process.local_ranks import run_ranks
    cfg = _data_cfg([corpus["txt"]], tokenizer_model=corpus["tok"], train_iters=8, eval_interval=8,
                    eval_iters=1, lr=1e-2)
    ref = _train_history(cfg)
    losses = [m["loss"] for m in ref]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(256), rel=0.1) and losses[-1] < losses[0] - 1.0, losses
    assert math.isfinite(ref[-1]["eval_loss"])
    ranks = run_ranks(_train_history, 2, cfg)
    for hist in ranks:  # fp32 Adam, DP 2 vs one process: R_TRAIN_ADAM (observed 2.7e-8 relative)
        assert [m["loss"] for m in hist] == pytest.approx(losses, rel=R_TRAIN_ADAM)


def test_eod_mask_loss_leaves_out_predictions_across_documents(corpus):
    from megazero.data import build_data, micro_batches
    from megazero.data.tokenizer import load_tokenizer
    eod = load_tokenizer(corpus["tok"]).eod
    cfg = validate(_data_cfg([corpus["txt"]], tokenizer_model=corpus["tok"], eod_mask_loss=True), 1)
    plain = validate(_data_cfg([corpus["txt"]], tokenizer_model=corpus["tok"]), 1)
    (masked,) = micro_batches(build_data(cfg), 0, 2, 2)
    (full,) = micro_batches(build_data(plain), 0, 2, 2)
    assert torch.equal(masked["tokens"], full["tokens"]) and full["loss_mask"].min() == 1
    at_eod = masked["tokens"] == eod
    assert at_eod.any()  # samples of 16 tokens from ~40-token paragraphs cross documents
    assert torch.equal(masked["loss_mask"], (~at_eod).float())
    with pytest.raises(ConfigError, match="--eod-mask-loss needs --tokenizer-model"):
        validate(_data_cfg([corpus["txt"]], eod_mask_loss=True), 1)


def test_preprocess_refuses_non_text_fields_naming_the_line(corpus, tmp_path, capsys):
    out = str(tmp_path / "o")
    for n, record in enumerate(('{"text": null}', '{"text": 12345}', '["text"]'), 1):
        bad = tmp_path / f"bad{n}.jsonl"
        bad.write_text('{"text": "fine"}\n' + record + "\n")
        assert preprocess_cli.main(["--input", str(bad), "--output-prefix", out, "--tokenizer-model",
                                    corpus["tok"]]) == 2
        err = capsys.readouterr().err
        assert f"bad{n}.jsonl:2" in err and err.count("error:") == 1, err
        assert (("is null" in err) if n == 1 else ("is int" in err) if n == 2
                else ("expected a JSON object" in err))
    assert not os.path.exists(out + "_text_document.bin")  # nothing written


def test_preprocess_unwritable_output_prefix_is_one_message(corpus, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # root can write anywhere, but not below a file
    code = preprocess_cli.main(["--input", str(corpus["dir"] / "c.jsonl"), "--output-prefix",
                                str(blocker / "sub" / "x"), "--tokenizer-model", corpus["tok"]])
    err = capsys.readouterr().err
    assert code == 2 and "--output-prefix" in err and "Traceback" not in err and err.count("error:") == 1


def test_separate_train_and_valid_sets(tmp_path):
    """--train-data-path / --valid-data-path (Megatron-LM's): training reads only the first set,
    evaluation only the second, no --split."""
    train_prefix = _numbered(tmp_path, "train", 40, base=0)
    valid_prefix = _numbered(tmp_path, "valid", 40, base=100, seed=1)
    cfg = validate(_data_cfg([], train_data_path=[train_prefix], valid_data_path=[valid_prefix],
                             eval_interval=2))
    data = build_data(cfg)
    assert int(data.get_tokens(range(16), "train").max()) < 40  # every token names a training document
    assert int(data.get_tokens(range(16), "valid").min()) >= 100
    with pytest.raises(ConfigError, match="--eval-interval with --train-data-path needs --valid-data-path"):
        validate(_data_cfg([], train_data_path=[train_prefix], eval_interval=2))
    with pytest.raises(ConfigError, match="--data-path and --train-data-path are exclusive"):
        validate(_data_cfg([train_prefix], train_data_path=[train_prefix]))
