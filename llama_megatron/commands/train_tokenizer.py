"""``llama-megatron train-tokenizer``: a LLaMA-style sentencepiece BPE from the same inputs as ``preprocess``."""

from __future__ import annotations

import argparse

from llama_megatron.data.readers import FORMATS, TEXT_UNITS
from llama_megatron.data.tokenizer import load_tokenizer
from llama_megatron.data.train_tokenizer import train


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", nargs="+", required=True, help="JSONL / text / parquet files or HF dataset dirs"
    )
    parser.add_argument("--input-format", default="auto", choices=("auto", *FORMATS))
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields whose text is used")
    parser.add_argument("--text-unit", default="line", choices=TEXT_UNITS, help="document unit of text files")
    parser.add_argument("--hf-split", default="train")
    parser.add_argument(
        "--output-dir", required=True, help="writes tokenizer.model and tokenizer_config.json here"
    )
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--character-coverage", type=float, default=0.99995)
    parser.add_argument(
        "--max-sentences", type=int, default=0, help="sample at most this many lines (0: all)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.model")


def run(args: argparse.Namespace) -> int:
    path = train(args)
    tok = load_tokenizer(path)
    print(
        f"wrote {path}: vocab {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_id}, pad {tok.pad_id} (= eos)"
    )
    return 0
