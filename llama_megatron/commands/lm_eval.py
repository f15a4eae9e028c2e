"""``llama-megatron lm-eval``: lm-evaluation-harness's own command line (``lm-eval run | ls | validate``, its
arguments unchanged) with our backend registered as ``llama_megatron``.

    llama-megatron lm-eval run --model llama_megatron --model_args checkpoint=DIR --batch_size 8 --tasks arc_easy
    deepspeed --num_gpus TP --module llama_megatron lm-eval run --model llama_megatron --model_args checkpoint=DIR ...

lm-eval 0.4.13 finds a model only in its own registry and reads no plugin entry points (EleutherAI/lm-evaluation-
harness#1457, #3282), so a plain ``lm_eval --model llama_megatron`` cannot see an installed package; this is the
workaround lm-eval's maintainers give (import the module that registers the model, then run lm-eval's CLI).
``lm_eval.simple_evaluate(model="llama_megatron", ...)`` finds it after ``import
llama_megatron.training.run.lm_harness``. Nothing is downloaded (docs/evaluation.md).
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
