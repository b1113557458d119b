"""preprocess_data.py as Megatron-LM's tools/preprocess_data.py: gzipped JSONL, parquet, directories and
globs as --input, --partitions (round robin, or sequential) merged in order, every tokenizer type, and
merge_datasets.py."""
import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter
from models.cli import merge_datasets as merge_cli
from models.cli import preprocess as preprocess_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_DOCS = 23


def _ids(i):
    """Document i: ids that name it (NullTokenizer reads ids written as text)."""
    return [i, 100 + i, 200 + (i % 7)][: 1 + i % 3]


@pytest.fixture()
def records(tmp_path):
    rows = [{"text": " ".join(map(str, _ids(i))), "title": str(300 + i)} for i in range(N_DOCS)]
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows[:10])
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows[10:])
    return tmp_path, rows


def _run(*args):
    return preprocess_cli.main(["--tokenizer-type", "NullTokenizer", "--vocab-size", "400", "--append-eod",
                                *args])


def _docs(prefix):
    ds = IndexedDataset(prefix)
    return [ds.document(k).tolist() for k in range(ds.num_documents)]


def test_a_directory_of_jsonl_and_gzipped_jsonl_keeps_input_order(records):
    tmp, rows = records
    assert _run("--input", str(tmp / "in"), "--output-prefix", str(tmp / "d"), "--json-keys", "text",
                "title") == 0
    assert _docs(str(tmp / "d_text_document")) == [_ids(i) + [400] for i in range(N_DOCS)]
    assert _docs(str(tmp / "d_title_document")) == [[300 + i, 400] for i in range(N_DOCS)]
    # a glob names the same files
    assert _run("--input", str(tmp / "in" / "*.json*"), "--output-prefix", str(tmp / "g")) == 0
    for ext in (".bin", ".idx"):
        assert open(str(tmp / "g_text_document") + ext, "rb").read() == \
            open(str(tmp / "d_text_document") + ext, "rb").read()


def test_parquet_rows_are_documents(records):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow reads parquet")
    import pyarrow as pa
    tmp, rows = records
    pq.write_table(pa.Table.from_pylist(rows), tmp / "r.parquet", row_group_size=5)
    assert _run("--input", str(tmp / "r.parquet"), "--output-prefix", str(tmp / "p")) == 0
    assert _docs(str(tmp / "p_text_document")) == [_ids(i) + [400] for i in range(N_DOCS)]
    assert _run("--input", str(tmp / "r.parquet"), "--output-prefix", str(tmp / "p"),
                "--json-keys", "body") == 2


@pytest.mark.parametrize("sequential", [False, True])
def test_partitions_are_written_and_merged_in_megatron_order(records, sequential):
    tmp, _ = records
    extra = ["--keep-sequential-samples"] if sequential else []
    assert _run("--input", str(tmp / "in"), "--output-prefix", str(tmp / "q"), "--partitions", "3",
                "--workers", "3", *extra) == 0
    if sequential:  # consecutive ranges of ceil(23 / 3) = 8: the input order survives the merge
        order = list(range(N_DOCS))
        assert _docs(str(tmp / "q_1_text_document")) == [_ids(i) + [400] for i in range(8, 16)]
    else:  # document i in partition i mod 3, partitions merged in order
        order = [i for p in range(3) for i in range(p, N_DOCS, 3)]
        assert _docs(str(tmp / "q_1_text_document")) == [_ids(i) + [400] for i in range(1, N_DOCS, 3)]
    assert _docs(str(tmp / "q_text_document")) == [_ids(i) + [400] for i in order]


def test_bad_inputs_get_one_line(records, capsys):
    tmp, _ = records
    with pytest.raises(SystemExit):
        _run("--input", str(tmp / "in"), "--output-prefix", str(tmp / "x"), "--partitions", "2",
             "--workers", "3")
    assert "--workers 3 is not a multiple of --partitions 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run("--input", str(tmp / "nothing-*.jsonl"), "--output-prefix", str(tmp / "x"))
    assert "no such file, directory or matching files" in capsys.readouterr().err
    (tmp / "words.jsonl").write_text('{"text": "not ids"}\n')
    assert _run("--input", str(tmp / "words.jsonl"), "--output-prefix", str(tmp / "x")) == 2
    assert "NullTokenizer reads token ids" in capsys.readouterr().err
    (tmp / "big.jsonl").write_text('{"text": "7 400"}\n')
    assert _run("--input", str(tmp / "big.jsonl"), "--output-prefix", str(tmp / "x")) == 2
    assert "token id 400 is outside [0, 400)" in capsys.readouterr().err
    (tmp / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "1"}\n' * 50)[:-12])
    assert _run("--input", str(tmp / "cut.jsonl.gz"), "--output-prefix", str(tmp / "x")) == 2
    assert "cut.jsonl.gz" in capsys.readouterr().err


def test_merge_datasets_appends_every_dataset_of_a_directory_in_name_order(tmp_path, capsys):
    (tmp_path / "parts").mkdir()
    for name, docs in (("b", [[5, 6], [7]]), ("a", [[1, 2, 3]]), ("c", [[9] * 4])):
        with IndexedDatasetWriter(str(tmp_path / "parts" / name), np.uint16) as w:
            for d in docs:
                w.add_document(d)
    assert merge_cli.main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "all")]) == 0
    assert _docs(str(tmp_path / "all")) == [[1, 2, 3], [5, 6], [7], [9] * 4]
    with IndexedDatasetWriter(str(tmp_path / "parts" / "d"), np.int32) as w:
        w.add_document([1])
    assert merge_cli.main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "dtype int32 differs from uint16" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert merge_cli.main(["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "y")]) == 2
    assert "no .bin/.idx pairs" in capsys.readouterr().err
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "merge_datasets.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--output-prefix" in out.stdout
