"""The ``llama-megatron`` command: one entry point with verbs.

Each verb lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; modules are
imported only when their verb is used so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from llama_megatron.errors import LlamaMegatronError

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("llama_megatron.train", "pretrain (one process; use the deepspeed launcher for many)"),
    "preprocess": ("llama_megatron.data.preprocess", "tokenize JSONL/text/parquet/HF datasets into .bin/.idx shards"),
    "train-tokenizer": ("llama_megatron.data.train_tokenizer", "train a LLaMA-style sentencepiece BPE tokenizer"),
    "convert": ("llama_megatron.checkpoint.convert_cli", "hf-to-megatron, meta-to-megatron, megatron-to-hf"),
    "reshard": ("llama_megatron.checkpoint.reshard_cli", "change a checkpoint's tensor/pipeline-parallel layout"),
    "export": ("llama_megatron.checkpoint.export_cli", "checkpoint (any TP/PP/ZeRO) -> Hugging Face directory"),
}


def _load_verb(verb: str):
    module_name, _ = VERBS[verb]
    return importlib.import_module(module_name)


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-megatron",
        description="Megatron-style TP/SP/PP LLaMA training on DeepSpeed, exact against HF transformers.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (_, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            _load_verb(name).add_arguments(verb_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = argv[0] if argv and argv[0] in VERBS else None
    parser = build_parser(verb)
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        return int(_load_verb(args.verb).run(args) or 0)
    except LlamaMegatronError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
