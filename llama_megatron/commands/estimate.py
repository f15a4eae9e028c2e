"""``llama-megatron estimate``: per-rank memory of a training config and the largest micro batch that fits."""

from __future__ import annotations

import argparse
import math

from llama_megatron.commands.train import add_config_arguments
from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.deepspeed_memory import bucket_note
from llama_megatron.training.diagnostics.memory_estimate import (
    Estimate,
    construction_bytes,
    estimate,
    largest_micro_batch,
    parse_bytes,
)
from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

ROWS = [("parameters", "parameters"), ("gradients", "gradients"), ("optimizer states", "optimizer"),
        ("ZeRO buffers", "buffers"), ("activations", "activations"), ("logits + loss", "logits"),
        ("fp8 operands", "fp8_transient"), ("rollout (decoding)", "rollout"), ("reference weights", "reference")]
# shown where a stage has some: ZeRO-1/2/3's buffers; online RL's decoding, held in place of the activations (the
# total counts the larger of the two), and its reference's weights
OPTIONAL_ROWS = ("buffers", "rollout", "reference")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: tensor x pipeline x context, i.e. data parallel 1; with "
                             "expert parallelism the smallest data axis the experts split over)")
    parser.add_argument("--gpu-memory", default="80GiB", help="memory of one accelerator (default 80GiB)")


def _unit(est: Estimate) -> tuple[str, int]:
    return ("GiB", 2**30) if est.peak_gpu >= 2**30 else ("MiB", 2**20)


def format_table(est: Estimate, seq_length: int) -> str:
    lines = [f"world size {est.world_size} | data parallel {est.data_parallel} | context {est.context} | "
             f"ZeRO {est.zero} | "
             f"{est.precision} | optimizer {est.optimizer_wrapper} | {est.micro_batches} micro batches per step "
             f"and rank, each {est.micro_batch_size} x {seq_length} tokens | kernels {est.kernels} | schedule "
             f"{est.schedule}"
             + (f" ({est.virtual_stages} virtual stages per rank)" if est.virtual_stages > 1 else ""),
             f"{_unit(est)[0]} per rank (GPU; CPU where offloaded)"]
    scale = _unit(est)[1]
    header = f"{'':18}" + "".join(f"{f'stage {s.stage} ({s.decoder_layers} layers)':>24}" for s in est.stages)
    lines.append(header)
    for label, attr in ROWS:
        if attr in OPTIONAL_ROWS and not any(getattr(s, attr) for s in est.stages):
            continue
        cells = []
        for s in est.stages:
            cpu = getattr(s, f"cpu_{attr}", 0)
            cpu_cell = f" +cpu {cpu / scale:.3f}" if cpu else ""
            cells.append(f"{f'{getattr(s, attr) / scale:.3f}{cpu_cell}':>24}")
        lines.append(f"{label:18}" + "".join(cells))
    # virtual stages: chunk passes (a micro batch through one chunk) held at the rank's peak
    held = "  micro batches" if est.virtual_stages == 1 else "  chunk passes"
    lines.append(f"{held:18}" + "".join(f"{s.in_flight:>24}" for s in est.stages))
    if any(s.deferred_micro_batches for s in est.stages):  # zb-h1, zb-v: passes whose W has not run, included
        if est.virtual_stages == 1:
            cells = [f"{s.deferred_micro_batches} x {s.deferred_per_micro_batch / scale:.3f}" for s in est.stages]
        else:
            cells = [str(s.deferred_micro_batches) for s in est.stages]
        lines.append(f"{'  + W pending':18}" + "".join(f"{cell:>24}" for cell in cells))
    lines.append(f"{'total GPU':18}" + "".join(f"{s.gpu_total / scale:>24.3f}" for s in est.stages))
    if any(s.async_save_host for s in est.stages):  # checkpoint.async_save's host copy, on the first DP rank
        lines.append(f"{'async save (host)':18}" + "".join(f"{s.async_save_host / scale:>24.3f}" for s in est.stages))
    if any(s.cpu_total for s in est.stages):
        lines.append(f"{'total CPU':18}" + "".join(f"{s.cpu_total / scale:>24.3f}" for s in est.stages))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    config = TrainingConfig.from_file(args.config, args.overrides)
    par = config.parallel
    world = args.world_size or par.tensor * par.pipeline * math.lcm(par.context, par.expert)
    config.check_world_size(world)
    budget = parse_bytes(args.gpu_memory)
    # "cuda" so fp16 configs (refused on a CPU *run*) can still be estimated for the GPUs they are meant for
    ds = build_deepspeed_config(config, args.deepspeed_config or config.deepspeed_config, world, "cuda")
    est = estimate(config, ds, world)
    print(format_table(est, config.seq_length))
    note = bucket_note(est.stages)
    if note:
        print(note)
    best = largest_micro_batch(config, ds, world, budget)
    verdict = "fits" if est.peak_gpu <= budget else "does NOT fit"
    print(f"peak {est.peak_gpu / 2**30:.3f} GiB per GPU {verdict} in {args.gpu_memory}")
    built = construction_bytes(config, ds, world)
    how = ("partitioned as it is made (ZeRO-3, distributed.zero3_init)" if est.zero == 3 and
           config.distributed.zero3_init else "whole on every rank, then handed to DeepSpeed")
    print(f"building the model: {built / 2**30:.3f} GiB per rank at most ({how})")
    if best is None:
        print("no micro batch fits (global batch kept; micro batch must divide global_batch / data parallel)")
    else:
        print(f"largest micro batch that fits: {best} (keeping global batch {config.batch.global_batch_size}; "
              "micro batch divides global_batch / data parallel)")
    return 0
