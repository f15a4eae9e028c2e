"""Peak memory per rank while a ZeRO-3 model is built and filled: partitioned as it is made (``zero.Init``,
``distributed.zero3_init: true``) against whole on every rank first (the path HF + DeepSpeed take without
``zero3_init_flag``), and against ``llama-megatron estimate``'s construction figure.

Each rank goes through the training setup path (preflight, process groups, ``load_model``) under the deepspeed
launcher, and reports its peak resident memory (the kernel's high-water mark, reset before each phase) above what
it held before building; the four phases run one after another in one launch. Twice per path:
built with the seeded initialisation (``init``), and filled from a converted checkpoint as a fine-tuning start
reads it, per tensor into each rank's slices (``load``: random HF weights written as ``save_pretrained`` does,
then ``llama-megatron convert hf-to-megatron``). One JSON line.

    python benchmarks/zero3_init_memory.py                      # a 0.54B shape at ZeRO-3 DP4 (fp32), ~1.5 minutes
    python benchmarks/zero3_init_memory.py --layers 2 --hidden 256 --ranks 2   # the smoke test's size
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llama_megatron.parallel.placement import launcher_command  # noqa: E402

ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _model(args) -> dict:
    return {"vocab_size": 32000, "hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4,
            "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": args.hidden // 64, "max_position_embeddings": 256}


def _config(args, zero3_init: bool, checkpoint: str | None) -> dict:
    config = {"model": _model(args), "data": {"type": "synthetic"}, "seq_length": 64,
              "batch": {"micro_batch_size": 1, "global_batch_size": args.ranks},
              "deepspeed_config": ZERO3, "distributed": {"zero3_init": zero3_init}, "kernels": "reference",
              "output_dir": os.path.join(args.work, f"run-{zero3_init}")}
    if checkpoint:
        config["checkpoint"] = {"load": checkpoint, "finetune": True}
    return config


def _converted_checkpoint(args) -> str:
    """Random weights in save_pretrained's layout, converted to a TP1 checkpoint (the fine-tuning start)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from convert_throughput import write_hf_input

    model_path, hf_dir, out = (os.path.join(args.work, name) for name in ("model.json", "hf", "converted"))
    with open(model_path, "w", encoding="utf-8") as fh:
        json.dump(_model(args), fh)
    write_hf_input(model_path, "fp32", hf_dir)
    subprocess.run([sys.executable, "-m", "llama_megatron.cli", "convert", "hf-to-megatron", "--hf-dir", hf_dir,
                    "--output", out, "--tp", "1"], cwd=ROOT, check=True, capture_output=True, text=True)
    shutil.rmtree(hf_dir)
    return out


def worker(paths: list[str], out: str) -> None:
    """One rank, one launch: per config in turn (each phase's model freed before the next is built), the resident
    memory before and the peak while building and filling its model. The peak is the kernel's high-water mark,
    reset before each phase (``/proc/self/clear_refs``), so one process measures every phase as four would."""
    from llama_megatron.parallel.placement import adopt_launcher_env
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.run.setup import load_model, preflight, start_process_groups

    adopt_launcher_env()
    import torch.distributed as dist

    measured = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            config = TrainingConfig.from_dict(json.load(fh))
        pre = preflight(config, config.deepspeed_config, mode="evaluate")
        pctx = start_process_groups(pre)
        gc.collect()
        dist.barrier()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # the high-water mark (VmHWM) back to the resident size now
        before = _status_kib("VmRSS")
        model = load_model(pre, pctx)
        measured.append({"before_mib": before / 1024, "peak_mib": _status_kib("VmHWM") / 1024})
        del model
        gc.collect()
        dist.barrier()
    with open(f"{out}.{pctx.rank}", "w", encoding="utf-8") as fh:
        json.dump(measured, fh)


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(f"{key}:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[1:], args.worker[0])
        return
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.diagnostics.memory_estimate import construction_bytes
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    with tempfile.TemporaryDirectory() as work:
        args.work = work
        result = {"benchmark": "zero3_init_memory", "ranks": args.ranks, "layers": args.layers,
                  "hidden": args.hidden}
        checkpoint = _converted_checkpoint(args)
        phases = list(itertools.product((False, True), ("init", "load")))
        configs, paths = [], []
        for zero3_init, phase in phases:
            configs.append(_config(args, zero3_init, checkpoint if phase == "load" else None))
            paths.append(os.path.join(work, f"config-{zero3_init}-{phase}"))
            with open(paths[-1], "w", encoding="utf-8") as fh:
                json.dump(configs[-1], fh)
        out = os.path.join(work, "rss")
        # tensors of 1 MiB and more mapped, as a real model's (above glibc's dynamic threshold of up to 32 MiB)
        # always are: a freed tensor's pages go back to the system instead of waiting in the heap for the next
        # phase (the heap holes would otherwise add to a phase's peak, or be reused by the next one)
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
        subprocess.run([*launcher_command(args.ranks), os.path.abspath(__file__), "--worker", out, *paths],
                       cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        ranks = [json.load(open(f"{out}.{r}", encoding="utf-8")) for r in range(args.ranks)]
        for index, ((zero3_init, phase), config) in enumerate(zip(phases, configs)):
            built = max(r[index]["peak_mib"] - r[index]["before_mib"] for r in ranks)
            typed = TrainingConfig.from_dict(config)
            ds = build_deepspeed_config(typed, typed.deepspeed_config, args.ranks, "cpu")
            key = "partitioned" if zero3_init else "whole"
            result[f"{key}_{phase}_peak_mib"] = round(built, 1)
            result[f"{key}_estimate_mib"] = round(construction_bytes(typed, ds, args.ranks) / 2**20, 1)
            result["parameters"] = typed.model.num_parameters()
        result["model_fp32_mib"] = round(result["parameters"] * 4 / 2**20, 1)
        for phase in ("init", "load"):
            result[f"{phase}_ratio_whole_to_partitioned"] = round(
                result[f"whole_{phase}_peak_mib"] / result[f"partitioned_{phase}_peak_mib"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
