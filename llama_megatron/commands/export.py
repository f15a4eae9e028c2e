"""``llama-megatron export`` (= ``convert megatron-to-hf``): a checkpoint of any layout -> an HF directory; a LoRA
checkpoint -> a PEFT adapter directory, or with ``--merge`` full HF weights with the adapters merged in."""

from __future__ import annotations

import argparse

from llama_megatron.checkpoint.interop.convert import to_hf
from llama_megatron.commands.checkpoint_args import add_export_arguments, parse_size, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_export_arguments(parser)
    lora = parser.add_argument_group("LoRA checkpoints (adapters only)")
    lora.add_argument("--merge", action="store_true",
                      help="write full HF weights: the base checkpoint with the adapters merged in (default: a PEFT "
                           "adapter directory, adapter_config.json + adapter_model.safetensors)")
    lora.add_argument("--base", default=None, metavar="DIR",
                      help="with --merge: the base checkpoint, if it moved from the path the adapters record "
                           "(checked against their fingerprint)")
    lora.add_argument("--base-model", default=None, metavar="NAME_OR_DIR",
                      help="the adapter config's base_model_name_or_path (e.g. the base exported with export)")


def run(args: argparse.Namespace) -> int:
    result = to_hf(args.input, args.output, dtype=args.dtype, tag=args.tag, tokenizer=args.tokenizer,
                   max_shard_bytes=parse_size(args.max_shard_size), overwrite=args.overwrite, show_progress=True,
                   merge=args.merge, base=args.base, base_model=args.base_model, into=args.into)
    return report("megatron-to-hf", result)
