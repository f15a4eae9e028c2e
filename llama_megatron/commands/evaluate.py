"""``llama-megatron evaluate``: the validation loss of ``checkpoint.load`` (same setup path as ``train``), or
lm-evaluation-harness tasks on a checkpoint under its own layout.

    deepspeed --num_gpus N --module llama_megatron evaluate --config X.json --set checkpoint.load=DIR
    deepspeed --num_gpus TP --module llama_megatron evaluate --checkpoint DIR --tasks shakespeare_play,arc_easy \\
        [--limit 100] [--num-fewshot 5] [--output results.json] [--log-samples samples.jsonl]
    deepspeed --num_gpus TPxPxE ... evaluate --checkpoint DIR --tasks ... --pipeline P --expert E

With ``--tasks`` (lm-eval task names, the tasks shipped in data/eval/tasks, or YAML files) every process is one rank
of the checkpoint's TP over ``--pipeline`` stages and ``--expert`` expert ranks (``training/run/lm_harness.py``);
rank 0 prints lm-eval's table and writes its results JSON.
Nothing is downloaded: a task's data must be local (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import json
import os

from llama_megatron.commands.generate import add_model_arguments
from llama_megatron.commands.train import add_config_arguments
from llama_megatron.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, config_required=False)
    tasks = parser.add_argument_group("lm-evaluation-harness (instead of --config)")
    tasks.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks or task YAML files")
    tasks.add_argument("--checkpoint", default=None, help="checkpoint directory (converted, trained or LoRA)")
    tasks.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    tasks.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: CHECKPOINT/hf_config)")
    tasks.add_argument("--limit", type=int, default=None, help="the first N documents of each task")
    tasks.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    tasks.add_argument("--batch-size", type=int, default=1, help="requests per forward pass (default 1)")
    tasks.add_argument("--seed", type=int, default=1234, help="few-shot sampling and every other seed")
    add_model_arguments(tasks)
    tasks.add_argument("--output", default=None, help="write lm-eval's results JSON here")
    tasks.add_argument("--log-samples", default=None, metavar="FILE.jsonl",
                       help="write every document's requests, responses and metrics here (lm-eval's samples)")
    tasks.add_argument("--overwrite", action="store_true", help="replace existing --output / --log-samples files")


def run(args: argparse.Namespace) -> int:
    from llama_megatron.parallel.placement import adopt_launcher_env

    if args.tasks is None:
        if args.config is None:
            raise ConfigError("give --config (the validation loss of checkpoint.load) or --tasks with --checkpoint "
                              "(lm-evaluation-harness tasks)")
        from llama_megatron.training.config import TrainingConfig
        from llama_megatron.training.run.loop import run_evaluation

        adopt_launcher_env()
        config = TrainingConfig.from_file(args.config, args.overrides)
        run_evaluation(config, args.deepspeed_config or config.deepspeed_config)
        return 0
    return _run_tasks(args)


def _run_tasks(args: argparse.Namespace) -> int:
    if args.config is not None or args.overrides:
        raise ConfigError("--tasks evaluates --checkpoint; --config and --set are for the validation loss")
    if args.checkpoint is None:
        raise ConfigError("--tasks needs --checkpoint DIR")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.num_fewshot is not None and args.num_fewshot < 0 or args.batch_size < 1:
        raise ConfigError("--num-fewshot must be >= 0 and --batch-size >= 1")
    if args.pipeline < 1 or args.expert < 1:
        raise ConfigError("--pipeline and --expert must be >= 1")
    for path in (args.output, args.log_samples):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(f"{path}: directory {parent} does not exist")
        if os.path.lexists(path) and not args.overwrite:
            raise ConfigError(f"{path} exists (pass --overwrite to replace it)")
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError("--tasks names no task")
    from llama_megatron.parallel.placement import adopt_launcher_env, placement
    from llama_megatron.training.run.lm_tasks import check_tasks

    adopt_launcher_env()
    tasks = check_tasks(names)  # before lm-eval's model code is imported, as before any process group
    from llama_megatron.training.run.lm_harness import (
        LlamaMegatronLM,
        evaluate_tasks,
        results_table,
        write_results,
        write_samples,
    )
    lm = LlamaMegatronLM(checkpoint=args.checkpoint, tag=args.tag, tokenizer=args.tokenizer, kernels=args.kernels,
                         dtype=args.dtype, pipeline=args.pipeline, expert=args.expert, batch_size=args.batch_size)
    results = evaluate_tasks(lm, tasks, args.limit, args.num_fewshot, args.seed,
                             log_samples=args.log_samples is not None)
    if placement().rank == 0:
        print(results_table(results), flush=True)
        if args.output:
            write_results(results, args.output)
        if args.log_samples:
            write_samples(results, args.log_samples)
        print(json.dumps({"evaluate": {task: results["results"][task] for task in results["results"]}},
                         default=str), flush=True)
    from llama_megatron.parallel.process_groups import barrier

    barrier()  # every rank done before any leaves; the groups stay up, as train leaves them (a later run reuses them)
    return 0
