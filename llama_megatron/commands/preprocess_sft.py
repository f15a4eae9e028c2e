"""``llama-megatron preprocess-sft``: chat / instruction JSONL -> token and mask shards for ``data.type: "sft"``
(``--format preference``: preference pairs for ``data.type: "preference"``).

    llama-megatron preprocess-sft --input data/chat/chat_messages.jsonl --tokenizer data/tokenizer \\
        --output-prefix data/processed/chat --workers 4

writes ``chat_tokens.bin/.idx``, ``chat_mask.bin/.idx`` and ``chat_sft.json``; train on them with
``"data": {"type": "sft", "prefix": "data/processed/chat"}``. (A config naming the JSONL with ``data.path`` does
the same on first use, into a cache.)
"""

from __future__ import annotations

import argparse

from llama_megatron.data.sft.formats import FORMATS, MASKING
from llama_megatron.data.sft.preference_formats import PREFERENCE_FORMAT
from llama_megatron.data.sft.preprocess import preprocess_sft


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files (.gz ok)")
    parser.add_argument("--tokenizer", required=True, help="HF tokenizer directory (its chat_template renders)")
    parser.add_argument("--output-prefix", required=True,
                        help="outputs are PREFIX_tokens.bin/.idx, PREFIX_mask.bin/.idx, PREFIX_sft.json")
    parser.add_argument("--format", default="auto", choices=(*FORMATS, PREFERENCE_FORMAT),
                        help="record format (auto: by each record's keys; preference: TRL's preference pairs, for "
                             "data.type preference)")
    parser.add_argument("--masking", default="assistant", choices=MASKING,
                        help="trained tokens: assistant turns (default; prompt/completion records: the "
                             "completion), all tokens, the last assistant turn, or assistant_only: assistant's "
                             "cut to what the template's {%% generation %%} markers enclose (TRL's assistant_only_loss); "
                             "not for preference pairs, whose completions are trained")
    parser.add_argument("--chat-template", default=None, help="Jinja file (default: the tokenizer's chat_template)")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes (1: all in this process)")
    parser.add_argument("--skip-bad-lines", action="store_true", help="count and skip unusable records")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.add_argument("--log-interval", type=float, default=2.0, help="seconds between progress lines")
    parser.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    stats = preprocess_sft(args.input, args.tokenizer, args.output_prefix, args.format, args.masking,
                           args.chat_template, args.workers, skip_bad=args.skip_bad_lines, overwrite=args.overwrite,
                           log_interval=args.log_interval, quiet=args.quiet)
    for prefix in stats["outputs"]:
        print(f"wrote {prefix}.bin/.idx")
    print(f"{stats['samples']:,} samples, {stats['tokens']:,} tokens of which {stats['trained_tokens']:,} trained, "
          f"{stats['skipped_records']} records skipped, {stats['seconds']:.1f}s")
    return 0
