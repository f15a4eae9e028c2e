"""``llama-megatron reshard``: a checkpoint of any TP/PP (ZeRO partitions included) -> another TP/PP."""

from __future__ import annotations

import argparse

from llama_megatron.checkpoint.interop.convert import reshard
from llama_megatron.checkpoint.interop.hf_writer import DTYPE_NAMES
from llama_megatron.checkpoint.megatron_writer import DEFAULT_TAG
from llama_megatron.commands.checkpoint_args import add_layout_arguments, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, metavar="DIR",
                        help="checkpoint directory (training save dir or converted)")
    parser.add_argument("--output", required=True, metavar="DIR", help="checkpoint directory to create")
    add_layout_arguments(parser)
    parser.add_argument("--tag", default=None, help="input tag (default: latest)")
    parser.add_argument("--output-tag", default=DEFAULT_TAG, help=f"tag of the output (default {DEFAULT_TAG})")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="weights dtype (default: as stored; ZeRO-3 partitions are fp32)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def run(args: argparse.Namespace) -> int:
    result = reshard(args.input, args.output, args.tp, args.pp, divisible_by=args.divisible_by, tag=args.tag,
                     out_tag=args.output_tag, dtype=args.dtype, overwrite=args.overwrite, show_progress=True)
    return report("reshard", result)
