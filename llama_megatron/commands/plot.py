"""``llama-megatron plot RUN_DIR [RUN_DIR ...]``: loss, validation loss, lr and tokens/s of runs in one PNG."""

from __future__ import annotations

import argparse
import os

from llama_megatron.training.diagnostics.plot import plot_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_dir (holds metrics.jsonl)")
    parser.add_argument("--output", default=None, metavar="FILE.png", help="default: RUN_DIR[0]/metrics.png")
    parser.add_argument("--x", choices=("step", "tokens", "both"), default="both",
                        help="x axis: step, tokens seen, or both side by side (default)")


def run(args: argparse.Namespace) -> int:
    output = args.output or os.path.join(args.run_dirs[0], "metrics.png")
    print(f"wrote {plot_runs(args.run_dirs, output, args.x)}")
    return 0
