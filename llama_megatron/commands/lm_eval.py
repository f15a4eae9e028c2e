"""``llama-megatron lm-eval``: lm-evaluation-harness's own command line (``lm-eval run | ls | validate``, its
arguments unchanged) with our backend registered as ``llama_megatron``.

    llama-megatron lm-eval run --model llama_megatron --model_args checkpoint=DIR --batch_size 8 --tasks arc_easy
    deepspeed --num_gpus TP --module llama_megatron lm-eval run --model llama_megatron --model_args checkpoint=DIR ...

lm-eval's own ``lm_eval`` finds the model as well where the package is installed (its start-up line:
llama_megatron/lm_eval_registration.py); the verb adds what a run of ours needs: the launcher's ``--module`` form, and
nothing downloaded (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="lm-eval's command and arguments (`llama-megatron lm-eval run --help` lists them)")


def run(args: argparse.Namespace) -> int:
    from llama_megatron.training.run.lm_tasks import go_offline

    go_offline()
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import llama_megatron.training.run.lm_harness  # noqa: F401 - registers the llama_megatron model

    saved = sys.argv
    sys.argv = ["lm-eval", *args.lm_eval_args]  # lm-eval's parser reads sys.argv (and inserts `run` if omitted)
    try:
        setup_logging()
        cli = HarnessCLI()
        cli.execute(cli.parse_args())
    except SystemExit as exc:  # its --help, and its argument errors (2)
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    finally:
        sys.argv = saved
    return 0
