"""The ``llama-megatron`` command (also ``python -m llama_megatron``): one entry point with verbs.

Each verb lives in its own module under :mod:`llama_megatron.commands`, exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their verb is used so ``--help`` stays fast. Under the
deepspeed launcher (``deepspeed --module llama_megatron train ...``) the ``--local_rank=N`` it inserts before
the verb is dropped: every rank reads LOCAL_RANK from the environment.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from llama_megatron.errors import exit_code_of
from llama_megatron.process_exit import exit_process

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "train": ("llama_megatron.commands.train", "pretrain or fine-tune (one process; the deepspeed launcher for many)"),
    "evaluate": ("llama_megatron.commands.evaluate", "validation loss of a checkpoint (same setup as train)"),
    "lm-eval": ("llama_megatron.commands.lm_eval", "lm-evaluation-harness's own CLI (run, ls, validate) with the "
                "llama_megatron model registered"),
    "generate": ("llama_megatron.commands.generate", "text from a checkpoint: chat template, greedy or sampled, KV cache"),
    "doctor": ("llama_megatron.commands.doctor", "check a multi-node setup under its launcher: ranks, files, bandwidth"),
    "profile": ("llama_megatron.commands.profile", "where a step's time goes: per-rank torch.profiler traces, time by "
                "category (launched as train)"),
    "estimate": ("llama_megatron.commands.estimate", "per-rank memory estimate and the largest micro batch that fits"),
    "plan": ("llama_megatron.commands.plan", "rank every parallel layout of a model on a cluster: memory, step time"),
    "plot": ("llama_megatron.commands.plot", "PNG of loss, validation loss, lr and tokens/s of one or more runs"),
    "preprocess": ("llama_megatron.commands.preprocess", "tokenize JSONL/text/parquet/HF datasets into .bin/.idx"),
    "preprocess-sft": ("llama_megatron.commands.preprocess_sft", "chat/instruction JSONL -> token + mask shards (SFT)"),
    "train-tokenizer": ("llama_megatron.commands.train_tokenizer", "train a LLaMA-style sentencepiece BPE tokenizer"),
    "convert": ("llama_megatron.commands.convert", "hf-to-megatron, meta-to-megatron, megatron-to-hf"),
    "reshard": ("llama_megatron.commands.reshard", "change a checkpoint's tensor/pipeline-parallel layout"),
    "export": ("llama_megatron.commands.export", "checkpoint (any TP/PP/ZeRO) -> Hugging Face directory"),
}


def _load_verb(verb: str):
    module_name, _ = VERBS[verb]
    return importlib.import_module(module_name)


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-megatron",
        description="Megatron-style TP/SP/PP/CP/EP LLaMA training on DeepSpeed, exact against HF transformers.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (_, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            _load_verb(name).add_arguments(verb_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith(("--local_rank", "--local-rank"))]
    verb = argv[0] if argv and argv[0] in VERBS else None
    parser = build_parser(verb)
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    return exit_code_of(lambda: _run_verb(args))


def _run_verb(args: argparse.Namespace) -> int | None:
    from llama_megatron.quiet import quiet_library_warnings

    quiet_library_warnings()  # before any verb imports DeepSpeed
    return _load_verb(args.verb).run(args)


def entry_point() -> NoReturn:
    """The ``llama-megatron`` console script: :func:`main` as the whole process."""
    exit_process(main())


if __name__ == "__main__":
    entry_point()
