"""``llama-megatron preprocess``: tokenise JSONL/text/parquet/HF datasets into Megatron ``.bin``/``.idx`` files."""

from __future__ import annotations

import argparse
import sys

from llama_megatron.data.preprocess import preprocess
from llama_megatron.data.readers import FORMATS, TEXT_UNITS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", nargs="+", required=True, help="JSONL (.gz ok), text, parquet files or HF dataset dirs"
    )
    parser.add_argument(
        "--input-format", default="auto", choices=("auto", *FORMATS), help="default: by extension"
    )
    parser.add_argument(
        "--json-keys", nargs="+", default=["text"], help="fields to tokenise; one output each"
    )
    parser.add_argument(
        "--text-unit", default="line", choices=TEXT_UNITS, help="what a document is in a text file"
    )
    parser.add_argument("--hf-split", default="train", help="split of a saved DatasetDict")
    parser.add_argument(
        "--tokenizer", required=True, help="tokenizer.model file, or a dir with it or tokenizer.json"
    )
    parser.add_argument("--tokenizer-backend", choices=("sentencepiece", "hf"), default=None)
    parser.add_argument("--output-prefix", required=True, help="outputs are PREFIX_{key}_document.bin/.idx")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eos token")
    parser.add_argument(
        "--workers", type=int, default=1, help="tokenising processes (1: all in this process)"
    )
    parser.add_argument("--chunk-bytes", type=int, default=1 << 20, help="input bytes per unit of work")
    parser.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed records")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--log-interval", type=float, default=2.0, help="seconds between progress lines")
    parser.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    stats = preprocess(args)
    if stats["bad_records"]:
        print(f"skipped {stats['bad_records']} malformed records", file=sys.stderr)
    if stats["documents"] == 0:
        print("warning: no documents were written (empty input?)", file=sys.stderr)
    for prefix in stats["outputs"]:
        print(f"wrote {prefix}.bin/.idx")
    print(
        f"{stats['documents']:,} documents, {stats['tokens']:,} tokens ({stats['dtype']}), "
        f"{stats['empty_documents']} empty skipped, {stats['seconds']:.1f}s"
    )
    return 0
