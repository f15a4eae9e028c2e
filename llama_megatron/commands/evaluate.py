"""``llama-megatron evaluate``: the validation loss of ``checkpoint.load`` (same setup path as ``train``).

    deepspeed --num_gpus N --module llama_megatron evaluate --config X.json --set checkpoint.load=DIR
"""

from __future__ import annotations

import argparse

from llama_megatron.commands.train import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from llama_megatron.parallel.placement import adopt_launcher_env
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.run.loop import run_evaluation

    adopt_launcher_env()
    config = TrainingConfig.from_file(args.config, args.overrides)
    run_evaluation(config, args.deepspeed_config or config.deepspeed_config)
    return 0
