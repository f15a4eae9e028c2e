"""What `llama-megatron profile` costs on the quickstart's run (TP2 x PP2, 4 processes, configs/pretrain/tiny-cpu.json).

- ``quickstart_profile_s``: the wall time of ``profile --steps 2:3`` of the quickstart's config, launch to exit (the
  launcher, 4 steps, the traces, the call graph of step 4 and its SVG, the summary).
- ``overhead``: the cost on the steps it does not profile. The same run (``train.steps`` N, no checkpoint, no
  evaluation, a log line every step) under ``train`` and under ``profile --steps N-3:N-2``, launched alternately
  ``--repeats`` times each; the tokens/s of steps 3 .. N-4 (none profiled, none under the call graph) compared:
  ``1 - profile / train`` over the medians (the profiled run wraps each pipeline instruction in a profiler range and
  each step in a ``with``; nothing else runs outside the steps asked).

One JSON line. Tokenises the shipped corpus first if the quickstart has not (as the quickstart does).

    python benchmarks/profile_overhead.py [--steps 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "pretrain", "tiny-cpu.json")
PREFIX = os.path.join(ROOT, "data", "processed", "shakespeare")
BIN = os.path.dirname(sys.executable)


def _launch(verb: str, args: list[str]) -> float:
    """Run ``verb`` on 4 local processes under the deepspeed launcher; its wall time."""
    from llama_megatron.parallel.placement import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [os.path.join(BIN, "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
               "--log_level", "warning", "--module", "llama_megatron", verb, "--config", CONFIG, *args]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{verb} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return seconds


def _tokens_per_s(output_dir: str, first: int, last: int) -> float:
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    return statistics.median(r["tokens_per_s"] for r in records if first <= r.get("step", 0) <= last
                             and "tokens_per_s" in r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="train.steps of the overhead runs (default 40)")
    parser.add_argument("--repeats", type=int, default=2, help="launches of each run, alternated (default 2)")
    args = parser.parse_args()
    if not os.path.exists(PREFIX + "_text_document.idx"):
        subprocess.run([os.path.join(BIN, "llama-megatron"), "preprocess", "--input",
                        os.path.join(ROOT, "data", "corpus", "shakespeare.jsonl"), "--tokenizer",
                        os.path.join(ROOT, "data", "tokenizer"), "--output-prefix", PREFIX, "--append-eod",
                        "--workers", "2"], check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as work:
        quickstart = _launch("profile", ["--steps", "2:3", "--output", os.path.join(work, "quickstart")])
        same = ["--set", f"train.steps={args.steps}", "--set", "logging.interval=1", "--set", "eval.interval=0",
                "--set", "checkpoint.load=null", "--set", "checkpoint.save=null", "--set", "checkpoint.interval=0",
                "--set", "logging.tensorboard_dir=null"]
        first, last = 3, args.steps - 4  # the profiled steps and the call graph's: N-3 .. N-1
        rates: dict[str, list[float]] = {"train": [], "profile": []}
        for repeat in range(args.repeats):
            out = os.path.join(work, f"train{repeat}")
            _launch("train", [*same, "--set", f"output_dir={out}"])
            rates["train"].append(_tokens_per_s(out, first, last))
            out = os.path.join(work, f"profile{repeat}")
            _launch("profile", [*same, "--steps", f"{args.steps - 3}:{args.steps - 2}", "--output", out])
            rates["profile"].append(_tokens_per_s(out, first, last))
    train, profile = statistics.median(rates["train"]), statistics.median(rates["profile"])
    print(json.dumps({"benchmark": "profile_overhead", "layout": "TP2 x PP2, 4 processes", "cores": os.cpu_count(),
                      "quickstart_profile_s": round(quickstart, 1), "steps_compared": [first, last],
                      "train_tokens_per_s": round(train, 1), "profile_unprofiled_tokens_per_s": round(profile, 1),
                      "overhead": round(1 - profile / train, 4),
                      "runs_tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()}}))


if __name__ == "__main__":
    main()
