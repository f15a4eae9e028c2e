"""``llama-megatron convert {hf-to-megatron, meta-to-megatron, megatron-to-hf}``."""

from __future__ import annotations

import argparse

from llama_megatron.checkpoint.interop.convert import to_hf, to_megatron
from llama_megatron.checkpoint.interop.hf_writer import DTYPE_NAMES
from llama_megatron.checkpoint.megatron_writer import DEFAULT_TAG
from llama_megatron.commands.checkpoint_args import (
    add_export_arguments,
    add_layout_arguments,
    parse_size,
    report,
)


def _add_to_megatron(parser: argparse.ArgumentParser, input_flag: str, input_help: str) -> None:
    parser.add_argument(input_flag, required=True, dest="input", metavar="DIR", help=input_help)
    parser.add_argument("--output", required=True, metavar="DIR", help="checkpoint directory to create")
    add_layout_arguments(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="weights dtype (default: as stored in the input)")
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"checkpoint tag to write (default {DEFAULT_TAG})")
    parser.add_argument("--max-position-embeddings", type=int, default=None, metavar="N",
                        help="Meta releases only (params.json lacks it): default 4096 LLaMA-2, 8192 LLaMA-3, "
                             "131072 with scaled rope")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    _add_to_megatron(sub.add_parser("hf-to-megatron", help="HF directory (or Meta release) -> checkpoint"),
                     "--hf-dir", "HF model directory (safetensors or .bin, sharded or not); a Meta release "
                     "(params.json + consolidated.*.pth) is detected too")
    _add_to_megatron(sub.add_parser("meta-to-megatron", help="Meta consolidated.*.pth release -> checkpoint"),
                     "--meta-dir", "directory with params.json and consolidated.XX.pth")
    add_export_arguments(sub.add_parser("megatron-to-hf", help="checkpoint (any TP/PP/ZeRO) -> HF directory"))


def run(args: argparse.Namespace) -> int:
    if args.direction == "megatron-to-hf":
        result = to_hf(args.input, args.output, dtype=args.dtype, tag=args.tag, tokenizer=args.tokenizer,
                       max_shard_bytes=parse_size(args.max_shard_size), overwrite=args.overwrite, show_progress=True,
                       into=args.into)
        return report(args.direction, result)
    result = to_megatron(args.input, args.output, args.tp, args.pp, divisible_by=args.divisible_by,
                         dtype=args.dtype, tag=args.tag, overwrite=args.overwrite,
                         max_position_embeddings=args.max_position_embeddings,
                         input_format="meta" if args.direction == "meta-to-megatron" else "auto", show_progress=True)
    return report(args.direction, result)
