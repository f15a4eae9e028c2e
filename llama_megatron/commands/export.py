"""``llama-megatron export`` (= ``convert megatron-to-hf``): a checkpoint of any layout -> an HF directory."""

from __future__ import annotations

import argparse

from llama_megatron.checkpoint.convert import to_hf
from llama_megatron.commands.checkpoint_args import add_export_arguments, parse_size, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_export_arguments(parser)


def run(args: argparse.Namespace) -> int:
    result = to_hf(args.input, args.output, dtype=args.dtype, tag=args.tag, tokenizer=args.tokenizer,
                   max_shard_bytes=parse_size(args.max_shard_size), overwrite=args.overwrite, show_progress=True)
    return report("megatron-to-hf", result)
