"""A mixture-of-experts layer's forward + backward on this CPU: our grouped experts against our loop (the reference
kernels' experts, one after another) and against transformers' own Mixtral block (``MixtralSparseMoeBlock``, its
default ``eager`` experts and its ``grouped_mm`` ones), on the same weights and tokens.

A Mixtral-like shape scaled to a CPU (Mixtral 8x7B: hidden 4096, intermediate 14336, 8 experts, top 2): hidden 256,
intermediate 896 (the same 3.5 ratio), 8 experts, top 2, 2 x 512 tokens, fp32. One JSON line: each variant's time
per forward + backward (the median of ``--repeats``), the ratios of the loop's and transformers' times to the grouped
path's (above 1: the grouped path is faster), and each output's largest difference from transformers'. Beside them
the GEMM floor: the experts' products alone as the largest GEMMs they could form (no routing, no split by expert),
and the loop's time over it, the most any experts kernel could gain over the loop on this CPU.

    python benchmarks/moe_layer.py
    python benchmarks/moe_layer.py --hidden 512 --intermediate 1792 --tokens 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _timing import median_ms  # noqa: E402

from llama_megatron.config import ModelConfig  # noqa: E402
from llama_megatron.model.kernels import REFERENCE  # noqa: E402
from llama_megatron.model.moe import MoEMLP  # noqa: E402
from llama_megatron.parallel.context import ParallelContext  # noqa: E402
from llama_megatron.parallel.degrees import ParallelConfig  # noqa: E402


def _hf_block(config: ModelConfig, implementation: str):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_config = MixtralConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                              num_local_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
                              experts_implementation=implementation)
    return MixtralSparseMoeBlock(hf_config)


def bench(args) -> dict:
    config = ModelConfig(model_type="mixtral", vocab_size=256, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=1, num_attention_heads=4,
                         num_local_experts=args.experts, num_experts_per_tok=args.top_k)
    shapes = ParallelConfig(make_vocab_size_divisible_by=1).local_shapes(config)
    torch.manual_seed(0)
    hf = {name: _hf_block(config, name) for name in ("eager", "grouped_mm")}
    with torch.no_grad():
        for block in hf.values():
            block.load_state_dict(hf["eager"].state_dict())
        for param in hf["eager"].parameters():
            param.normal_(0, 0.02)
        for block in hf.values():
            block.load_state_dict(hf["eager"].state_dict())
    ours = {}
    for name, kernels in (("loop", REFERENCE), ("grouped", dataclasses.replace(REFERENCE, grouped_experts=True))):
        layer = MoEMLP(config, ParallelContext.single(), shapes, kernels)
        with torch.no_grad():  # transformers' fused experts: gate_up [E, 2I, H] (gate rows, then up), down [E, H, I]
            layer.router.weight.copy_(hf["eager"].gate.weight)
            for e, expert in enumerate(layer.experts.values()):
                expert.gate_up_proj.weight.copy_(hf["eager"].experts.gate_up_proj[e])
                expert.down_proj.weight.copy_(hf["eager"].experts.down_proj[e])
        ours[name] = layer
    x = torch.randn(args.batch, args.tokens // args.batch, args.hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn_like(x)

    def ours_step(layer):
        def step():
            out, _ = layer(x.requires_grad_(True))
            out.backward(grad)
            return out
        return step

    def hf_step(block):
        def step():
            out = block(x.requires_grad_(True))
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)
            return out
        return step

    steps = {**{f"ours_{name}": ours_step(layer) for name, layer in ours.items()},
             **{f"hf_{name}": hf_step(block) for name, block in hf.items()}}
    floor = _gemm_floor_step(config, x, args.top_k)
    want = steps["hf_eager"]().detach()
    result: dict = {"benchmark": "moe_layer", "hidden": args.hidden, "intermediate": args.intermediate,
                    "experts": args.experts, "top_k": args.top_k, "tokens": args.tokens, "dtype": "float32",
                    "threads": torch.get_num_threads()}
    for name, step in steps.items():
        error = float((step().detach() - want).abs().max())
        result[name] = {"ms": median_ms(step, args.repeats), "max_abs_error_vs_hf": error}
    result["gemm_floor"] = {"ms": median_ms(floor, args.repeats)}
    grouped = result["ours_grouped"]["ms"]
    for name in ("ours_loop", "hf_eager", "hf_grouped_mm"):
        result[f"ratio_{name}_time_vs_ours_grouped"] = round(result[name]["ms"] / grouped, 3)
    # the most any experts kernel could gain over our loop here: the loop's time over the GEMMs' own
    result["ratio_ours_loop_time_vs_gemm_floor"] = round(result["ours_loop"]["ms"] / result["gemm_floor"]["ms"], 3)
    return result


def _gemm_floor_step(config: ModelConfig, x: torch.Tensor, top_k: int):
    """The experts' arithmetic with nothing around it: every routed row (tokens x top_k) through one gate/up
    product, SwiGLU and one down product, forward and backward, as if all experts were one: the same FLOPs as the
    experts' GEMMs in the largest GEMMs they could form, no router, no permutation, no per-expert split. No experts
    kernel can be faster than this on the same CPU."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    gen = torch.Generator().manual_seed(2)
    rows = x.reshape(-1, hidden).repeat(top_k, 1).requires_grad_(True)
    gate_up = (torch.randn(2 * intermediate, hidden, generator=gen) * 0.02).requires_grad_(True)
    down = (torch.randn(hidden, intermediate, generator=gen) * 0.02).requires_grad_(True)
    grad = torch.randn(rows.shape[0], hidden, generator=gen)

    def step():
        gate, up = (rows @ gate_up.t()).chunk(2, dim=-1)
        out = (torch.nn.functional.silu(gate) * up) @ down.t()
        out.backward(grad)
        return out
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=896)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per forward (batch x sequence)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps(bench(args)), flush=True)


if __name__ == "__main__":
    main()
