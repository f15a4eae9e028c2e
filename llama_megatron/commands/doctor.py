"""``llama-megatron doctor``: check a multi-node setup before a long job, under the launcher the job will use.

    deepspeed --num_gpus 8 --hostfile H --module llama_megatron doctor --config configs/pretrain/X.json
    torchrun --nnodes 4 --node_rank N --nproc_per_node 8 ... -m llama_megatron doctor --config X.json
    srun --ntasks-per-node 8 python -m llama_megatron doctor --config X.json

Every rank reports; rank 0 prints a table and writes OUTPUT_DIR/doctor.json (or --output): ranks present, versions
and config the same everywhere, data and tokenizer files identical, the checkpoint dir writable and shared,
all-reduce bandwidth per TP/CP/DP group and send/recv between pipeline stages, stragglers, the NCCL environment.
Exit 0 when every check passes, 2 when one fails, 5 when a rank is missing or stops (named, within the timeout).
"""

from __future__ import annotations

import argparse

from llama_megatron.commands.train import add_config_arguments
from llama_megatron.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--timeout-minutes", type=float, default=5.0,
                        help="how long to wait for a missing or stopped rank before naming it (default 5)")
    parser.add_argument("--output", default=None, help="the JSON report (default OUTPUT_DIR/doctor.json)")


def run(args: argparse.Namespace) -> int:
    from llama_megatron.parallel.placement import adopt_launcher_env
    from llama_megatron.training.config import TrainingConfig
    from llama_megatron.training.diagnostics.doctor import run_doctor

    if not args.timeout_minutes > 0:
        raise ConfigError(f"--timeout-minutes must be > 0, got {args.timeout_minutes}")
    config = TrainingConfig.from_file(args.config, args.overrides)
    where = adopt_launcher_env()
    config.check_world_size(where.world_size)
    return run_doctor(config, where, args.timeout_minutes, args.output)
