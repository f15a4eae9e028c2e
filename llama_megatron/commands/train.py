"""``llama-megatron train``: pretraining (and fine-tuning from ``checkpoint.load`` + ``finetune``).

    deepspeed --num_gpus N --module llama_megatron.train --config configs/pretrain/X.json [--set key=value ...]
    llama-megatron train --config configs/pretrain/X.json          # one process, no launcher needed
    torchrun --nnodes 2 --node_rank N ... -m llama_megatron.train ...; srun python -m llama_megatron.train ...
"""

from __future__ import annotations

import argparse
import sys

from llama_megatron.errors import exit_code_of
from llama_megatron.process_exit import exit_process


def add_config_arguments(parser: argparse.ArgumentParser, config_required: bool = True) -> None:
    """The arguments of every command that starts from a training JSON (train, evaluate, ...)."""
    parser.add_argument("--config", required=config_required, help="training JSON (model, parallel, data, batch, ...)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a training-config key, e.g. --set train.steps=50 --set parallel.tensor=2")
    parser.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                        help="DeepSpeed JSON (overrides the training config's deepspeed_config)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


class _HelpConfig(argparse.Action):
    """``--help-config``: print every key of the training JSON (type, default, meaning) and exit, as --help does."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from llama_megatron.commands.config_reference import render

        sys.stdout.write(render())
        parser.exit()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--help-config", action=_HelpConfig,
                        help="print every key of the training JSON: type, default, meaning (docs/configuration.md)")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate checkpoint.load on the validation split (= llama-megatron evaluate)")


def run(args: argparse.Namespace) -> int:
    from llama_megatron.parallel.placement import adopt_launcher_env
    from llama_megatron.training.config import TrainingConfig

    adopt_launcher_env()
    config = TrainingConfig.from_file(args.config, args.overrides)
    # DeepSpeed is imported once the config is known to be good
    from llama_megatron.training.run.loop import run_pretraining

    run_pretraining(config, args.deepspeed_config or config.deepspeed_config, eval_only=args.eval_only)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llama_megatron.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    from llama_megatron.quiet import quiet_library_warnings

    quiet_library_warnings()  # before DeepSpeed is imported (`llama-megatron train` does this in cli.py)
    return exit_code_of(lambda: run(args))


if __name__ == "__main__":
    exit_process(main())
