"""Time and peak RSS of ``convert hf-to-megatron`` and ``megatron-to-hf`` against transformers'
``from_pretrained`` + ``save_pretrained`` of the same model, in the same run.

The HF input (random weights, sharded safetensors as ``save_pretrained`` writes them) is written once and read
by every side from a warm page cache. Each side runs in a fresh process (``--child``): seconds are measured
around the work only (imports excluded), peak RSS is the process's VmHWM, and each side's fixed overhead (peak
RSS of a process that only imports the same modules) is measured too, so "peak - overhead" is what the work
itself costs. Best of ``--repeats`` for time; the largest peak is reported.

    python benchmarks/convert_throughput.py [--config configs/models/llama-50m.json] [--dtype fp32] [--tp 2 --pp 2]

Prints one JSON line.
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

MB = 2**20


def peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(kind: str, args: list[str]) -> dict:
    """Runs in a fresh process: import, then time one job."""
    if kind.startswith("ours"):
        from llama_megatron.checkpoint.interop.convert import to_hf, to_megatron
    else:
        from transformers import LlamaForCausalLM
    start = time.perf_counter()
    if kind == "ours-to-megatron":
        src, out, tp, pp = args
        to_megatron(src, out, int(tp), int(pp))
    elif kind == "ours-to-hf":
        src, out = args
        to_hf(src, out)
    elif kind == "transformers":
        src, out = args
        model = LlamaForCausalLM.from_pretrained(src, dtype="auto", local_files_only=True)
        loaded = time.perf_counter()
        model.save_pretrained(out)
        return {"seconds": time.perf_counter() - start, "load_seconds": loaded - start, "peak_rss": peak_rss()}
    return {"seconds": time.perf_counter() - start, "peak_rss": peak_rss()}


def run_child(kind: str, *args: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    if result.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_hf_input(config_path: str, dtype_name: str, path: str) -> tuple[int, int, int]:
    """Random weights in save_pretrained's layout; returns (parameters, bytes, largest layer bytes)."""
    import torch
    from safetensors.torch import save_file

    from llama_megatron.checkpoint.interop.hf_writer import DTYPE_NAMES, hf_config_dict
    from llama_megatron.checkpoint.interop.safetensors_stream import plan_shards
    from llama_megatron.config import ModelConfig
    from llama_megatron.model.param_layout import ParamLayout

    config = ModelConfig.from_file(config_path)
    dtype = DTYPE_NAMES[dtype_name]
    layout = ParamLayout(config)
    shapes = layout.hf_shapes()
    os.makedirs(path)
    generator = torch.Generator().manual_seed(0)
    shards = plan_shards([(n, s, dtype) for n, s in shapes.items()], 2 * 10**9)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {n: (torch.randn(s, generator=generator) * 0.02).to(dtype) for n, s, _ in shard}
        save_file(state, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in state})
    total = sum(torch.Size(s).numel() for s in shapes.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total * dtype.itemsize}, "weight_map": weight_map}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf_config_dict(config, dtype), fh)
    return total, total * dtype.itemsize, max(layout.numel_by_layer().values()) * dtype.itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs/models/llama-50m.json"))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1:])), flush=True)
        return

    work = tempfile.mkdtemp(prefix="convert-bench-", dir=args.workdir)
    try:
        hf = os.path.join(work, "hf")
        params, nbytes, layer = write_hf_input(args.config, args.dtype, hf)
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            for name in ("ckpt", "hf-out", "tf-out"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
            runs.setdefault("to_megatron", []).append(run_child("ours-to-megatron", hf, os.path.join(work, "ckpt"),
                                                                str(args.tp), str(args.pp)))
            runs.setdefault("to_hf", []).append(run_child("ours-to-hf", os.path.join(work, "ckpt"),
                                                          os.path.join(work, "hf-out")))
            runs.setdefault("transformers", []).append(run_child("transformers", hf, os.path.join(work, "tf-out")))
        idle_ours = run_child("ours-idle")["peak_rss"]
        idle_tf = run_child("transformers-idle")["peak_rss"]

        def best(name: str) -> dict:
            return {"seconds": round(min(r["seconds"] for r in runs[name]), 3),
                    "peak_rss_mb": round(max(r["peak_rss"] for r in runs[name]) / MB, 1)}

        to_megatron, to_hf, tf = best("to_megatron"), best("to_hf"), best("transformers")
        tf["load_seconds"] = round(min(r["load_seconds"] for r in runs["transformers"]), 3)
        result = {
            "benchmark": "convert_throughput",
            "config": os.path.relpath(args.config, ROOT),
            "dtype": args.dtype,
            "tp": args.tp,
            "pp": args.pp,
            "parameters": params,
            "model_mb": round(nbytes / MB, 1),
            "largest_layer_mb": round(layer / MB, 1),
            "hf_to_megatron": {**to_megatron, "mb_per_s": round(nbytes / MB / to_megatron["seconds"], 1),
                               "work_rss_mb": round(to_megatron["peak_rss_mb"] - idle_ours / MB, 1)},
            "megatron_to_hf": {**to_hf, "mb_per_s": round(nbytes / MB / to_hf["seconds"], 1),
                               "work_rss_mb": round(to_hf["peak_rss_mb"] - idle_ours / MB, 1)},
            "transformers_from_pretrained_save_pretrained": {
                **tf, "mb_per_s": round(nbytes / MB / tf["seconds"], 1),
                "work_rss_mb": round(tf["peak_rss_mb"] - idle_tf / MB, 1)},
            "fixed_overhead_mb": {"ours": round(idle_ours / MB, 1), "transformers": round(idle_tf / MB, 1)},
            "repeats": args.repeats,
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
