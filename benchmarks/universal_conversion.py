"""Time to convert a ZeRO checkpoint to DeepSpeed's universal format (what a resume at another DP x CP degree
waits for): our conversion's worker count (``checkpoint.universal_workers`` 0: twice the cores, at most 8,
bounded by memory) against one worker each (what this project ran before) and against ``ds_to_universal``'s own defaults
(4 extract, 4 merge workers: what Megatron-DeepSpeed users run by hand).

A ZeRO-1 fp32 checkpoint is written by a real 2-process training run (one step, synthetic data), then converted
by :func:`llama_megatron.checkpoint.universal.conversion.ensure_universal` as rank 0 does, once per worker setting,
each into a fresh output. One JSON line.

    python benchmarks/universal_conversion.py                          # a 0.54B shape, ~6 minutes
    python benchmarks/universal_conversion.py --layers 2 --hidden 256 --repeats 1  # the smoke test's size
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llama_megatron.parallel.placement import launcher_command  # noqa: E402


def _config(args, work: str) -> dict:
    return {"model": {"vocab_size": 32000, "hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4,
                      "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
                      "num_key_value_heads": args.hidden // 64, "max_position_embeddings": 256},
            "data": {"type": "synthetic"}, "seq_length": 64,
            "batch": {"micro_batch_size": 1, "global_batch_size": args.ranks}, "train": {"steps": 1},
            "optimizer": {"lr": 1e-5, "warmup_steps": 0},
            "deepspeed_config": {"zero_optimization": {"stage": 1}}, "kernels": "reference",
            "checkpoint": {"save": os.path.join(work, "ckpt"), "interval": 1},
            "output_dir": os.path.join(work, "run")}


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks of the saving run")
    parser.add_argument("--repeats", type=int, default=2, help="conversions per setting (the best is reported)")
    args = parser.parse_args()
    from llama_megatron.checkpoint.universal.conversion import conversion_workers, ensure_universal

    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "config.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(_config(args, work), fh)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([*launcher_command(args.ranks), "--module", "llama_megatron.train", "--config", path],
                       cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        ckpt, tag = os.path.join(work, "ckpt"), "global_step1"
        auto = conversion_workers(os.path.join(ckpt, tag))
        result = {"benchmark": "universal_conversion", "layers": args.layers, "hidden": args.hidden,
                  "saved_at_dp": args.ranks, "checkpoint_gib": round(_tree_bytes(os.path.join(ckpt, tag)) / 2**30, 2),
                  "cores": len(os.sched_getaffinity(0)), "auto_workers": list(auto)}
        settings = (("auto", 0), ("one_worker", 1), ("deepspeed_default", 4))
        for repeat in range(args.repeats):  # alternating order, the best of each: the page cache favours none
            for name, workers in settings if repeat % 2 == 0 else settings[::-1]:
                start = time.perf_counter()
                converted = ensure_universal(ckpt, tag, rank=0, log=lambda line: print(line, file=sys.stderr),
                                             workers=workers)
                seconds = time.perf_counter() - start
                result[f"{name}_seconds"] = round(min(seconds, result.get(f"{name}_seconds", seconds)), 2)
                result["universal_gib"] = round(_tree_bytes(os.path.join(ckpt, converted)) / 2**30, 2)
                shutil.rmtree(os.path.join(ckpt, converted))
        result["auto_gib_per_s"] = round(result["universal_gib"] / result["auto_seconds"], 3)
        result["speedup_vs_one_worker"] = round(result["one_worker_seconds"] / result["auto_seconds"], 2)
        result["speedup_vs_deepspeed_default"] = round(result["deepspeed_default_seconds"] / result["auto_seconds"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
