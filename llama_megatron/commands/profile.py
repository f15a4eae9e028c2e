"""``llama-megatron profile``: where a training step's time goes, per rank (torch.profiler traces and a summary).

    deepspeed --num_gpus N --module llama_megatron profile --config X.json --steps 3:5 --output prof/
    llama-megatron profile --config X.json --steps 2 --ranks 0 --output prof/      # one process

The run trains as ``train`` would (same launchers, layouts and numbers, the learning-rate schedule over the
config's ``train.steps``; no checkpoint saved, no evaluation; from the start, or from the checkpoint
``checkpoint.load`` names: ``auto`` is read as none) and stops after the step that follows the last one
asked (the call graph's); the steps asked are recorded on the ranks asked: ``rank{R}.trace.json`` for
ui.perfetto.dev, chrome://tracing or TensorBoard, ``summary.json`` and a table of time by category
(``training/diagnostics/profiling.py``), beside the run's ``metrics.jsonl`` in the same directory.
"""

from __future__ import annotations

import argparse
import os

from llama_megatron.commands.train import add_config_arguments
from llama_megatron.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", default="2:3",
                        help="the run's steps to record, FIRST:LAST or one step, counted from 1 (default 2:3: step 1 "
                             "warms up)")
    parser.add_argument("--ranks", default="all", help="global ranks to record: 'all' (default) or e.g. 0,3")
    parser.add_argument("--output", required=True, help="directory for the traces, summary.json and the run's logs")
    parser.add_argument("--overwrite", action="store_true", help="replace what --output holds")


def run(args: argparse.Namespace) -> int:
    import shutil

    from llama_megatron.parallel.placement import adopt_launcher_env, placement
    from llama_megatron.training.config import AUTO_LOAD, TrainingConfig
    from llama_megatron.training.config_sections import read_config_data
    from llama_megatron.training.diagnostics.profiling import ProfileRequest

    adopt_launcher_env()
    request = ProfileRequest.parse(args.steps, args.ranks, os.path.abspath(args.output))
    where = placement()
    if os.path.exists(request.output) and os.listdir(request.output) and not args.overwrite:
        raise ConfigError(f"--output {args.output} exists and is not empty: pass --overwrite to replace it")
    overrides = [*args.overrides, f"output_dir={request.output}", "eval.interval=0"]
    data = read_config_data(args.config, overrides)  # train.steps kept: the LR schedule spans it
    checkpoint = data.setdefault("checkpoint", {})
    if checkpoint.get("load") == AUTO_LOAD:  # a run profiled from its start (a checkpoint named is loaded)
        checkpoint["load"] = None
    checkpoint["save"], checkpoint["interval"] = None, 0
    config = TrainingConfig.from_dict(data)
    request.check(config.train.steps, where.world_size)
    if args.overwrite and where.rank == 0 and os.path.isdir(request.output):
        shutil.rmtree(request.output)  # before any rank writes: the launcher's ranks start together, rank 0 first
    return _profile(config, request, args.deepspeed_config or config.deepspeed_config, args.config)


def _profile(config, request, ds_source, config_path: str) -> int:
    import torch.distributed as dist

    from llama_megatron.parallel.placement import placement
    from llama_megatron.training.diagnostics.collective_traffic import rank_step_bytes
    from llama_megatron.training.diagnostics.flops import training_flops_per_token
    from llama_megatron.training.diagnostics.memory_estimate import ELEMENT_BYTES, estimate
    from llama_megatron.training.diagnostics.profiling import (
        StepProfiler,
        bytes_against_formula,
        summary_table,
        write_summary,
    )
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config
    from llama_megatron.training.run.loop import run_pretraining

    profiler = StepProfiler(request, placement().rank)
    run_pretraining(config, ds_source, profiler=profiler)
    mine = profiler.finish()
    gathered = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    ranks = [r for r in gathered if r is not None]
    element = ELEMENT_BYTES[profiler.precision]
    world = placement().world_size
    stages = estimate(config, build_deepspeed_config(config, ds_source, world), world).stages
    for rank in ranks:  # each collective's bytes beside the layout's formula for that pipeline rank
        if "call_graph" in rank:
            formula = rank_step_bytes(config, world, rank["pipeline_rank"], element)
            rank["call_graph"]["bytes_vs_formula"] = bytes_against_formula(rank["call_graph"]["collectives"], formula)
        stage = stages[rank["pipeline_rank"]]  # and its memory beside `estimate`'s for its stage
        rank["memory"]["estimate"] = {"gradients, activations and logits": stage.gradients + stage.activations
                                      + stage.logits, "total": stage.gpu_total}
    if placement().rank == 0:
        extra = {"config": os.path.abspath(config_path), "world_size": placement().world_size}
        if len(ranks) == placement().world_size and all("call_graph" in r for r in ranks):
            # every rank's count of the call graph's step against the MFU formula's FLOPs of a step
            tokens = config.batch.global_batch_size * config.seq_length
            extra["flops_of_a_step"] = {"counted": sum(r["call_graph"]["flops"] for r in ranks),
                                        "formula": training_flops_per_token(config.model, config.seq_length) * tokens}
        path = write_summary(request.output, ranks, extra)
        print(summary_table(ranks), flush=True)
        print(f"profile: {len(ranks)} rank(s), steps {request.first}-{request.last}: {path}", flush=True)
    return 0
