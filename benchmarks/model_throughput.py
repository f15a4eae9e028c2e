"""Training-step throughput of llama_megatron's model (TP=1) against transformers.LlamaForCausalLM (sdpa).

Same config, same weights, same batches, same (fused) AdamW, one process. Prints one JSON line per kernel
choice of ours (``--kernels``, default: reference and compiled): tokens/s of each, their ratio, achieved
GFLOP/s and MFU against a fp32 matmul peak measured in this run.

    python benchmarks/model_throughput.py [--config configs/models/llama-50m.json] [--seq 512] [--steps 5]
        [--kernels reference,compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llama_megatron.config import ModelConfig  # noqa: E402
from llama_megatron.model.build import build_model  # noqa: E402
from llama_megatron.model.kernels import resolve_kernels  # noqa: E402
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict  # noqa: E402
from llama_megatron.parallel.context import ParallelContext  # noqa: E402
from llama_megatron.parallel.degrees import ParallelConfig  # noqa: E402
from llama_megatron.training.diagnostics.flops import training_flops_per_token  # noqa: E402
from llama_megatron.training.run.metrics import measured_matmul_tflops  # noqa: E402


def time_steps(step, batches, warmup: int) -> float:
    for ids in batches[:warmup]:
        step(ids)
    start = time.perf_counter()
    for ids in batches[warmup:]:
        step(ids)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs/models/llama-50m.json"))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernels", default="reference,compiled", help="comma-separated kernel choices")
    args = parser.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_file(args.config)
    hf = LlamaForCausalLM(LlamaConfig(**config.to_hf_dict(), attn_implementation="sdpa")).float()
    parallel = ParallelConfig()
    state = hf_to_rank_state_dict(hf.state_dict(), config, 0, 1, parallel.padded_vocab_size(config.vocab_size))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
               for _ in range(args.warmup + args.steps)]

    def make_step(model, loss_of):
        # fused AdamW on both sides: what llama_megatron's trainer and HF Trainer (torch>=2.8) use by default
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(ids):
            optimizer.zero_grad(set_to_none=True)
            loss_of(model, ids).backward()
            optimizer.step()
        return step

    hf_step = make_step(hf, lambda m, ids: m(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss)
    tokens = args.batch * args.seq * args.steps
    peak = measured_matmul_tflops(n=2048, repeats=10) * 1e3  # GFLOP/s
    flops = training_flops_per_token(config, args.seq) * tokens
    for choice in args.kernels.split(","):
        kernels = resolve_kernels(choice, "cpu")
        ours = build_model(config, parallel, ParallelContext.single(), initialize=False, kernels=kernels)
        ours.load_state_dict(state)
        ours_step = make_step(ours, lambda m, ids: m(ids[:, :-1], labels=ids[:, 1:]))
        ours_step(batches[0])  # compiles, for kernels that do
        # Alternate the two for several rounds and keep each side's best, so machine noise hits both alike.
        hf_time = ours_time = float("inf")
        for _ in range(args.rounds):
            hf_time = min(hf_time, time_steps(hf_step, batches, args.warmup))
            ours_time = min(ours_time, time_steps(ours_step, batches, args.warmup))
        result = {
            "benchmark": "model_throughput",
            "config": os.path.basename(args.config),
            "kernels": kernels.name,
            "params_m": round(config.num_parameters() / 1e6, 1),
            "seq": args.seq,
            "batch": args.batch,
            "threads": torch.get_num_threads(),
            "ours_tokens_per_s": round(tokens / ours_time, 1),
            "hf_tokens_per_s": round(tokens / hf_time, 1),
            "ratio": round(hf_time / ours_time, 3),
            "ours_gflops": round(flops / ours_time / 1e9, 2),
            "hf_gflops": round(flops / hf_time / 1e9, 2),
            "matmul_peak_gflops": round(peak, 2),
            "ours_mfu": round(flops / ours_time / 1e9 / peak, 3),
            "hf_mfu": round(flops / hf_time / 1e9 / peak, 3),
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
