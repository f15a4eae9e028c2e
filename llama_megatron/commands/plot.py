"""``llama-megatron plot RUN_DIR [RUN_DIR ...]``: loss, validation loss, lr and tokens/s of runs in one PNG;
``llama-megatron plot --profile DIR``: a profiled pipeline step per rank (F, B, W, idle) and its memory."""

from __future__ import annotations

import argparse
import os

from llama_megatron.errors import ConfigError
from llama_megatron.training.diagnostics.plot import plot_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="a run's output_dir (holds metrics.jsonl)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="instead: the --output of `llama-megatron profile` of a pipeline run: each rank's F, B "
                             "and W passes, sends and receives and idle time, and its memory, over the profiled steps")
    parser.add_argument("--output", default=None, metavar="FILE.png",
                        help="default: RUN_DIR[0]/metrics.png (with --profile: DIR/timeline.png)")
    parser.add_argument("--x", choices=("step", "tokens", "both"), default="both",
                        help="x axis: step, tokens seen, or both side by side (default)")


def run(args: argparse.Namespace) -> int:
    if args.profile is not None:
        # only here: a profile's timeline reads the profiler's ranges through torch and DeepSpeed (some 3 s of
        # imports a plot of runs does without)
        from llama_megatron.training.diagnostics.profile_plot import plot_profile

        if args.run_dirs:
            raise ConfigError("give run directories or --profile DIR, not both")
        print(f"wrote {plot_profile(args.profile, args.output or os.path.join(args.profile, 'timeline.png'))}")
        return 0
    if not args.run_dirs:
        raise ConfigError("give a run directory (RUN_DIR, its metrics.jsonl) or --profile DIR")
    output = args.output or os.path.join(args.run_dirs[0], "metrics.png")
    print(f"wrote {plot_runs(args.run_dirs, output, args.x)}")
    return 0
