"""GPU training-step throughput: ours (each kernel choice) vs transformers (sdpa) vs transformers + Liger-Kernel.

One process, the same config, weights and batches, bf16 parameters, a train step = forward + backward + fused
AdamW. Prints one JSON line per model shape (tokens/s, MFU, peak GiB of each variant and the ratios against HF
and HF + Liger; with ``--profile`` each variant's longest kernels and its host synchronisations per step) and one per per-document attention length (fwd+bwd time and peak memory of the reference dense
mask, our fast path, causal SDPA and FlexAttention with a document block mask).

    python benchmarks/gpu_throughput.py                      # TinyLlama-1.1B seq 2048 x 4, Llama-2-7B dims x 8 layers,
                                                             # Mixtral-8x7B dims x 2 layers (the MoE layer vs HF's)
    python benchmarks/gpu_throughput.py --only attention     # per-document attention at seq 2k / 8k / 32k
    python benchmarks/gpu_throughput.py --smoke              # tiny shapes, any device: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
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
from llama_megatron.model.kernels.attention import FastAttention, ReferenceAttention  # noqa: E402
from llama_megatron.model.moe import pack_experts  # noqa: E402
from llama_megatron.model.param_layout import as_checkpoint_tensors  # noqa: E402
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict  # noqa: E402
from llama_megatron.parallel.context import ParallelContext  # noqa: E402
from llama_megatron.parallel.degrees import ParallelConfig  # noqa: E402
from llama_megatron.parallel.float8 import Float8Config  # noqa: E402
from llama_megatron.training.diagnostics.flops import training_flops_per_token  # noqa: E402
from llama_megatron.training.run.metrics import device_peak_tflops  # noqa: E402

SHAPES = {  # name -> (model config file, overrides, seq, micro batch)
    "tinyllama-1.1b": ("configs/models/tinyllama-1.1b.json", {}, 2048, 4),
    "llama2-7b-8layers": ("configs/models/llama2-7b.json", {"num_hidden_layers": 8}, 4096, 1),
    # two MoE layers of Mixtral's size: the step is mostly the experts (ours vs transformers' MixtralSparseMoeBlock)
    "mixtral-8x7b-2layers": ("configs/models/mixtral-8x7b.json", {"num_hidden_layers": 2}, 4096, 1),
}
SMOKE_SHAPES = {"smoke": ("configs/models/tiny.json", {}, 64, 2),
                "smoke-moe": ("configs/models/tiny-moe.json", {"num_hidden_layers": 2}, 64, 2)}
ATTENTION_LENGTHS = (2048, 8192, 32768)


def have_liger() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def top_kernels(step, ids, device: torch.device, count: int = 12) -> list:
    """One more step under torch's profiler: its ``count`` longest kernels (device ms, calls) and their total."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step(ids)
        _sync(device)
    rows = [(e.key, e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total, e.count)
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return [["total", round(total / 1e3, 2), sum(r[2] for r in rows)]] + [
        [name[:90], round(us / 1e3, 2), calls] for name, us, calls in rows[:count]]


def host_syncs(step, ids, device: torch.device) -> int | None:
    """The device-to-host synchronisations of one step (CUDA: torch's sync debug mode warns at each ``.item()``,
    ``.tolist()``, ``nonzero``, host copy); None elsewhere (a CPU has nothing to wait for)."""
    if device.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(ids)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def time_train_steps(model, loss_of, batches, warmup: int, device: torch.device,
                     profile: bool = False) -> tuple[float, float | None] | tuple[float, float | None, list, int | None]:
    """Seconds for the timed steps and the peak memory of the whole (warm-up included) run; with ``profile``, the
    top kernels of one more step (after the timing) and the host synchronisations of another."""
    _reset_peak(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        optimizer.step()

    for ids in batches[:warmup]:
        step(ids)
    _sync(device)
    start = time.perf_counter()
    for ids in batches[warmup:]:
        step(ids)
    _sync(device)
    elapsed = time.perf_counter() - start
    if profile:
        peak = _peak_gib(device)
        return elapsed, peak, top_kernels(step, batches[-1], device), host_syncs(step, batches[-1], device)
    return elapsed, _peak_gib(device)


def apply_liger(model_type: str) -> bool:
    """Liger-Kernel's patch of transformers' classes of this family (every model built afterwards), if it has one."""
    import liger_kernel.transformers as liger

    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if patch is not None:
        patch()
    return patch is not None


def bench_shape(name: str, spec, args, device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    path, overrides, seq, micro = spec
    config = ModelConfig.from_dict({**json.load(open(os.path.join(ROOT, path))), **overrides})
    torch.manual_seed(0)
    hf_config = transformers.CONFIG_MAPPING[config.model_type](**config.to_hf_dict(), attn_implementation="sdpa")
    hf_class = getattr(transformers, config.family.architecture)
    parallel = ParallelConfig()
    with torch.device(device):  # initialised where it runs (a 7B-wide model's init on the host takes minutes)
        hf_state = {name: t.cpu() for name, t in hf_class(hf_config).state_dict().items()}  # kept off the device
    state = hf_to_rank_state_dict(as_checkpoint_tensors(hf_state, config), config, 0, 1,
                                  parallel.padded_vocab_size(config.vocab_size))

    def hf_model():
        with torch.device(device):
            model = hf_class(hf_config)
        model.load_state_dict(hf_state)
        return model.to(dtype=dtype)

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (micro, seq + 1), generator=gen).to(device)
               for _ in range(args.warmup + args.steps)]
    tokens = micro * seq * args.steps
    flops = training_flops_per_token(config, seq) * tokens
    peak = device_peak_tflops(None) if device.type == "cuda" else None
    result: dict = {"benchmark": "gpu_throughput", "shape": name, "device": torch.cuda.get_device_name()
                    if device.type == "cuda" else "cpu", "dtype": str(dtype).removeprefix("torch."),
                    "model_type": config.model_type, "seq": seq, "micro_batch": micro,
                    "layers": config.num_hidden_layers}

    began = time.perf_counter()

    def record(label: str, seconds: float, peak_gib: float | None, kernels: list | None = None,
               syncs: int | None = None) -> None:
        """``wall_s``: the variant's whole time (building, loading, compiling, warm-up, timing, profiling);
        ``host_syncs`` (profiled runs): a step's device-to-host synchronisations (None off CUDA)."""
        nonlocal began
        tflops = flops / seconds / 1e12
        result[label] = {"tokens_per_s": round(tokens / seconds, 1), "tflops": round(tflops, 2),
                         "mfu": round(tflops / peak, 3) if peak else None, "peak_gib": peak_gib,
                         "wall_s": round(time.perf_counter() - began, 1)}
        began = time.perf_counter()
        if kernels:
            result[label]["top_kernels_ms"] = kernels
            result[label]["host_syncs"] = syncs

    def ours_loss(m, ids):
        return m(ids[:, :-1], labels=ids[:, 1:])

    def hf_loss(m, ids):
        return m(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss

    choices = args.kernels.split(",") if args.kernels else (
        ["reference", "compiled"] + (["liger"] if have_liger() else []))
    fp8 = Float8Config(recipe=args.fp8) if args.fp8 else None
    for choice in choices:
        for precision in ("bf16", "fp8") if fp8 else ("bf16",):
            model = build_model(config, parallel, ParallelContext.single(), initialize=False,
                                kernels=resolve_kernels(choice, device), fp8=fp8 if precision == "fp8" else None)
            model.load_state_dict(state)
            model.to(device=device, dtype=dtype)
            pack_experts(model)  # the move copied each expert's parameters apart (the training engine packs too)
            label = f"ours_{choice}" + ("_fp8" if precision == "fp8" else "")
            record(label, *time_train_steps(model, ours_loss, batches, args.warmup, device, args.profile))
            del model
    if fp8:  # torchtitan's way: torchao's convert_to_float8_training on the HF model's linears (not the head)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        hf = hf_model()
        convert_to_float8_training(hf, config=Float8LinearConfig.from_recipe_name(args.fp8),
                                   # not the head, nor an MoE block's router (HF's ``mlp.gate``)
                                   module_filter_fn=lambda m, fqn: fqn != "lm_head" and not fqn.endswith(".gate"))
        record("hf_torchao_fp8", *time_train_steps(hf, hf_loss, batches, args.warmup, device, args.profile))
        del hf
    hf = hf_model()
    record("hf", *time_train_steps(hf, hf_loss, batches, args.warmup, device, args.profile))
    del hf
    # patches transformers' classes of the family for every model built afterwards: last (a new process per shape
    # would be cleaner; one process keeps the device's time short, and the unpatched runs come first)
    if have_liger() and apply_liger(config.model_type):
        hf = hf_model()
        record("hf_liger", *time_train_steps(hf, hf_loss, batches, args.warmup, device, args.profile))
        del hf
    for key in [k for k in result if k.startswith("ours_")]:
        for base in ("hf", "hf_liger", "hf_torchao_fp8", *(("ours_" + key[5:-4],) if key.endswith("_fp8") else ())):
            if base in result:
                result[f"ratio_{key}_vs_{base}"] = round(result[key]["tokens_per_s"] / result[base]["tokens_per_s"],
                                                         3)
    return result


def _documents(seq: int, doc_len: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(seq, device=device) // doc_len).unsqueeze(0)


def time_attention(fn, q, k, v, repeats: int, device: torch.device) -> tuple[float, float | None]:
    """Mean ms of forward + backward, and the peak memory."""
    for _ in range(2):
        fn(q, k, v).sum().backward()
    _reset_peak(device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(q, k, v).sum().backward()
    _sync(device)
    return round((time.perf_counter() - start) / repeats * 1e3, 3), _peak_gib(device)


def bench_attention(seq: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    """Packed documents of ~1k tokens (32 heads, 4 KV heads, head_dim 64, batch 1), as docs/benchmarks.md describes."""
    heads, kv_heads, head_dim = (32, 4, 64) if not args.smoke else (4, 2, 16)
    segments = _documents(seq, max(seq // 32, 1) if args.smoke else 1024, device)
    gen = torch.Generator(device=device).manual_seed(0)

    def leaf(n):
        return torch.randn(1, seq, n, head_dim, generator=gen, device=device, dtype=dtype).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    variants = {
        "reference_dense_mask": lambda q, k, v: ReferenceAttention()(q, k, v, segments),
        "ours_fast": lambda q, k, v: FastAttention()(q, k, v, segments),
        "causal_sdpa_no_documents": lambda q, k, v: FastAttention()(q, k, v, None),
    }
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        from llama_megatron.model.kernels.attention import document_block_mask

        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = document_block_mask(segments)
        variants["flex_attention"] = lambda q, k, v: flex(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
            enable_gqa=True).transpose(1, 2)
    result: dict = {"benchmark": "gpu_attention", "seq": seq, "heads": heads, "kv_heads": kv_heads,
                    "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch.")}
    for label, fn in variants.items():
        if seq > 8192 and label == "reference_dense_mask" and device.type != "cuda":
            continue
        ms, gib = time_attention(fn, q, k, v, args.attention_repeats, device)
        result[label] = {"ms": ms, "peak_gib": gib}
    if "flex_attention" in result:
        ours, flex = result["ours_fast"], result["flex_attention"]
        result["ours_fast_time_vs_flex"] = round(ours["ms"] / flex["ms"], 3)
        result["ours_fast_memory_vs_flex"] = round(ours["peak_gib"] / flex["peak_gib"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["models", "attention"], help="run one half")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--kernels", default="", help="our kernel choices (default: reference, compiled, liger)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--attention-repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="each variant's top kernels in one profiled step")
    parser.add_argument("--fp8", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
                        help="also ours with fp8 of this recipe, and HF with torchao's float8 (docs/fp8.md)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs a CUDA device (use --smoke to check the script on CPU)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    if args.only != "attention":
        for name, spec in shapes.items():
            print(json.dumps(bench_shape(name, spec, args, device, dtype)), flush=True)
    if args.only != "models":
        for seq in ((128,) if args.smoke else ATTENTION_LENGTHS):
            print(json.dumps(bench_attention(seq, args, device, dtype)), flush=True)


if __name__ == "__main__":
    main()
