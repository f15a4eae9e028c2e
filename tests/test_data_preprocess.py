"""``llama-megatron preprocess``: every input format, worker ordering, and every bad-input path."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from llama_megatron.cli import main
from llama_megatron.data.indexed_dataset import MMapIndexedDataset
from llama_megatron.data.preprocess import _init_worker, ordered_map
from llama_megatron.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = str(REPO / "data" / "tokenizer")
CORPUS = REPO / "data" / "corpus" / "shakespeare.jsonl"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in itertools.islice(CORPUS.open(encoding="utf-8"), 40)]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


def run_cli(*args: str) -> int:
    return main(["preprocess", "--tokenizer", TOKENIZER, "--quiet", *args])


def docs_of(prefix) -> list[list[int]]:
    ds = MMapIndexedDataset(str(prefix))
    assert len(ds) == ds.num_documents  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


def test_jsonl_with_eod(tmp_path, records, tok):
    src = write_jsonl(tmp_path / "in.jsonl", records)
    assert run_cli("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--append-eod") == 0
    prefix = tmp_path / "out_text_document"
    assert MMapIndexedDataset(str(prefix)).dtype == np.uint16
    assert docs_of(prefix) == [tok.encode(r["text"], eos=True) for r in records]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "out_text_document.bin", "out_text_document.idx"]


@pytest.mark.launched
def test_two_workers_write_identical_bytes(tmp_path, records):
    src = write_jsonl(tmp_path / "in.jsonl", records * 3)
    for workers in ("1", "2"):
        args = ["--input", str(src), "--output-prefix", str(tmp_path / f"w{workers}"), "--workers", workers]
        assert run_cli(*args, "--chunk-bytes", "8192", "--append-eod") == 0  # many chunks: order matters
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"w1_text_document{ext}").read_bytes()
        assert a == (tmp_path / f"w2_text_document{ext}").read_bytes()


def test_several_json_keys_make_megatron_named_outputs(tmp_path, records, tok):
    src = write_jsonl(tmp_path / "in.jsonl", records[:5])
    assert (
        run_cli("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "text", "title")
        == 0
    )
    assert docs_of(tmp_path / "o_text_document") == [tok.encode(r["text"]) for r in records[:5]]
    assert docs_of(tmp_path / "o_title_document") == [tok.encode(r["title"]) for r in records[:5]]


def test_text_units_and_gzip(tmp_path, tok):
    text = "First line\nsecond line\n\n\nThird, after blanks\nand more\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    expected = {
        "line": ["First line", "second line", "Third, after blanks", "and more"],
        "paragraph": ["First line\nsecond line", "Third, after blanks\nand more"],
        "document": [text.rstrip("\n")],
    }
    for unit, docs in expected.items():
        for name in ("a.txt", "b.txt.gz"):
            out = tmp_path / f"{unit}-{name}"
            assert (
                run_cli("--input", str(tmp_path / name), "--output-prefix", str(out), "--text-unit", unit)
                == 0
            )
            assert docs_of(f"{out}_text_document") == [tok.encode(d) for d in docs]


OVERLONG_TEXT = {  # (file, its first bad document's line, what, the documents kept) under a 1000-byte bound
    "line": ("short\n" + "x" * 3000 + "\nafter\n", 2, ["short", "after"]),
    "paragraph": ("a\nb\n\n" + ("y" * 400 + "\n") * 4 + "\nc\n\n\n" + "z" * 3000 + "\nd\n", 4, ["a\nb", "c"]),
    "document": ("w" * 3000 + "\n", 1, []),
}


@pytest.mark.parametrize("unit", list(OVERLONG_TEXT))
def test_an_overlong_text_document_is_a_bad_record_read_in_bounded_pieces(unit, tmp_path, monkeypatch, capsys, tok):
    """A text line, paragraph (four lines within the bound, over it together; one over it alone) or whole file
    longer than the bound is refused with FILE:LINE (exit 2), or skipped and counted; no read returns more than the
    bound (a 2 GB line is never held whole)."""
    from llama_megatron.data import readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1000)
    text, lineno, kept = OVERLONG_TEXT[unit]
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    args = ("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--text-unit", unit)
    assert run_cli(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}:{lineno}: {unit} longer than 1000 bytes") and "--skip-bad-lines" in err
    assert sorted(os.listdir(tmp_path)) == ["in.txt"]
    assert run_cli(*args, "--skip-bad-lines") == 0
    assert docs_of(tmp_path / "o_text_document") == [tok.encode(d) for d in kept]
    skipped = 2 if unit == "paragraph" else 1
    assert f"skipped {skipped} malformed records" in capsys.readouterr().err
    reads: list[int] = []

    class Counted(io.BytesIO):
        def read(self, size=-1):
            reads.append(len(data := super().read(size)))
            return data

        def readline(self, size=-1):
            reads.append(len(data := super().readline(size)))
            return data

    assert [doc for _, doc in readers._text_documents(Counted(text.encode()), unit) if doc] == [
        d.encode() for d in kept]
    assert max(reads) <= 1001


def test_parquet_input_and_bad_rows(tmp_path, tok, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": ["To be", "or not", None, "to be"], "id": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "in.parquet")
    out = str(tmp_path / "pq")
    assert run_cli("--input", str(tmp_path / "in.parquet"), "--output-prefix", out) == 2
    assert "in.parquet: row 2: key 'text' is NoneType, not a string" in capsys.readouterr().err
    assert run_cli("--input", str(tmp_path / "in.parquet"), "--output-prefix", out, "--skip-bad-lines") == 0
    assert docs_of(out + "_text_document") == [tok.encode(t) for t in ("To be", "or not", "to be")]
    assert (
        run_cli("--input", str(tmp_path / "in.parquet"), "--output-prefix", out + "x", "--json-keys", "body")
        == 2
    )
    assert "no column body (columns: text, id)" in capsys.readouterr().err


def test_hf_datasets_inputs(tmp_path, tok, records, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = records[:12]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    assert run_cli("--input", str(tmp_path / "saved"), "--output-prefix", str(tmp_path / "a")) == 0
    assert docs_of(tmp_path / "a_text_document") == [tok.encode(r["text"]) for r in rows]
    # a DatasetDict: the split is chosen by --hf-split; a shuffled (indices-mapped) split keeps its order
    shuffled = ds.shuffle(seed=3)
    datasets.DatasetDict({"train": ds, "validation": shuffled}).save_to_disk(str(tmp_path / "dd"))
    args = [
        "--input",
        str(tmp_path / "dd"),
        "--output-prefix",
        str(tmp_path / "b"),
        "--hf-split",
        "validation",
    ]
    assert run_cli(*args) == 0
    assert docs_of(tmp_path / "b_text_document") == [tok.encode(t) for t in shuffled["text"]]
    # local data files through datasets.load_dataset
    src = write_jsonl(tmp_path / "files.jsonl", rows[:3])
    assert run_cli("--input", str(src), "--input-format", "hf", "--output-prefix", str(tmp_path / "c")) == 0
    assert docs_of(tmp_path / "c_text_document") == [tok.encode(r["text"]) for r in rows[:3]]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"text": "unterminated}', "invalid JSON"),
        ('["a", "list"]', "expected a JSON object, got list"),
        ('{"body": "no text key"}', "no key 'text' (keys: body)"),
        ('{"text": 42}', "key 'text' is int, not a string"),
        ("[" * 100_000, "invalid JSON (nested too deeply)"),  # RecursionError in the parser
        ('{"text": "' + "x" * 200_000 + '"}', "line longer than 150000 bytes"),
    ],
    ids=["unterminated", "list", "no-key", "not-a-string", "nested", "overlong"],
)
def test_malformed_json_line_names_file_and_line(tmp_path, capsys, monkeypatch, bad_line, message):
    monkeypatch.setattr("llama_megatron.data.readers.MAX_LINE_BYTES", 150_000)  # read in the main process
    src = write_jsonl(
        tmp_path / "bad.jsonl", [{"text": "fine"}, "", {"text": "also fine"}, bad_line, {"text": "end"}]
    )
    assert run_cli("--input", str(src), "--output-prefix", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}:4: {message}") and "--skip-bad-lines" in err
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # nothing half-written, no temporaries
    assert run_cli("--input", str(src), "--output-prefix", str(tmp_path / "o"), "--skip-bad-lines") == 0
    assert len(docs_of(tmp_path / "o_text_document")) == 3
    assert "skipped 1 malformed records" in capsys.readouterr().err


def test_invalid_utf8_in_text_names_line(tmp_path, capsys):
    (tmp_path / "t.txt").write_bytes(b"good\nbad \xff byte\n")
    assert run_cli("--input", str(tmp_path / "t.txt"), "--output-prefix", str(tmp_path / "o")) == 2
    assert f"{tmp_path / 't.txt'}:2: invalid UTF-8" in capsys.readouterr().err


@pytest.mark.launched
def test_bad_line_in_a_later_chunk_with_workers(tmp_path, records, capsys):
    rows = records * 2 + ["{oops"] + records[:3]
    src = write_jsonl(tmp_path / "big.jsonl", rows)
    args = [
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "o"),
        "--workers",
        "2",
        "--chunk-bytes",
        "4096",
    ]
    assert run_cli(*args) == 2
    assert f"{src}:{len(records) * 2 + 1}: invalid JSON" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]


def test_existing_output_needs_overwrite(tmp_path, records, capsys, tok):
    src = write_jsonl(tmp_path / "in.jsonl", records[:2])
    out = str(tmp_path / "o")
    assert run_cli("--input", str(src), "--output-prefix", out) == 0
    assert run_cli("--input", str(src), "--output-prefix", out) == 2
    assert "o_text_document.bin exists; pass --overwrite" in capsys.readouterr().err
    src2 = write_jsonl(tmp_path / "in2.jsonl", records[2:3])
    assert run_cli("--input", str(src2), "--output-prefix", out, "--overwrite") == 0
    assert docs_of(out + "_text_document") == [tok.encode(records[2]["text"])]


def test_empty_texts_skipped_and_missing_input(tmp_path, capsys, tok):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": ""}, {"text": "x"}, {"text": ""}])
    assert run_cli("--input", str(src), "--output-prefix", str(tmp_path / "o")) == 0
    out = capsys.readouterr().out
    assert "1 documents" in out and "2 empty skipped" in out
    assert docs_of(tmp_path / "o_text_document") == [tok.encode("x")]
    assert run_cli("--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "p")) == 2
    assert "input not found" in capsys.readouterr().err
    assert run_cli("--input", str(tmp_path / "x.csv"), "--output-prefix", str(tmp_path / "p")) == 2
    assert "cannot tell the format" in capsys.readouterr().err


def test_progress_line_reports_rates(tmp_path, records, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", records[:3])
    assert (
        main(
            [
                "preprocess",
                "--tokenizer",
                TOKENIZER,
                "--input",
                str(src),
                "--output-prefix",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "preprocess: 3 docs" in err and "docs/s" in err and "tokens/s" in err


def test_int32_tokens_for_a_large_vocab(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 70_000, "world": 5}
    rust = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    rust.save(str(tmp_path / "tok" / "tokenizer.json"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world"}])
    args = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--append-eod", "--quiet"]
    assert main(["preprocess", "--tokenizer", str(tmp_path / "tok"), *args]) == 0
    ds = MMapIndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.dtype == np.int32 and ds[0].tolist() == [70_000, 5, 2]


def _identity(x):
    return x


def _noop_init(*_):
    pass


@pytest.mark.launched
def test_ordered_map_keeps_order_and_bounds_read_ahead():
    pulled = []

    def source():
        for i in range(40):
            pulled.append(i)
            yield i

    results = []
    for value in ordered_map(_identity, source(), 2, _noop_init, (), in_flight_per_worker=2):
        results.append(value)
        assert len(pulled) - len(results) <= 4  # never more than workers * in_flight ahead of the consumer
    assert results == list(range(40))
    assert list(ordered_map(_identity, iter(range(5)), 1, _init_worker, (None, ["text"], False))) == list(
        range(5)
    )
