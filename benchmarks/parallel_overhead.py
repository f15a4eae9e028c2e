"""Per-step time and communicated bytes of TP / SP / PP layouts, next to Megatron's analytic figures.

For every configuration it launches the real training engine under the `deepspeed` launcher on synthetic data,
counts the bytes each rank sends through torch.distributed (all-reduce, all-gather, reduce-scatter, broadcast,
send/recv) during the timed steps, and prints one JSON line:

- measured: step time, bytes per step per rank (by collective) and TP bytes per decoder layer;
- analytic: Megatron's TP volume per layer (forward 2 and backward 2 all-reduces of b*s*h activations, ring
  cost 2(t-1)/t each; with SP an all-gather + reduce-scatter pair of the same total), and the pipeline bubble
  (p-1)/(m+p-1) against the measured step time relative to PP=1;
- with TP x PP, the bytes one rank sends to the next stage per micro batch (forward: its 1/t of the b*s*h
  activation plus the int64 position ids; backward: its 1/t of the gradient). Without SP DeepSpeed cuts the
  replicated activation into t pieces and all-gathers them on the receiving stage (``pipe_partitioned``); with
  SP each rank sends its own sequence shard, the same bytes, and no all-gather is needed.

    python benchmarks/parallel_overhead.py            # all configurations (a few minutes on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 1024}
SEQ = 256
CONFIGS = [
    {"tp": 1, "pp": 1, "sp": False, "micro_batches": 1},
    {"tp": 2, "pp": 1, "sp": False, "micro_batches": 1},
    {"tp": 2, "pp": 1, "sp": True, "micro_batches": 1},
    *({"tp": 1, "pp": 2, "sp": False, "micro_batches": m} for m in (1, 2, 4, 8)),
    {"tp": 2, "pp": 2, "sp": False, "micro_batches": 4},
    {"tp": 2, "pp": 2, "sp": True, "micro_batches": 4},
]
TP_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single")  # what the model's TP layers call
SENDS = ("send", "isend")


def _count_bytes(counter: dict) -> None:
    """Wrap torch.distributed's collectives so every call adds the bytes this rank sends."""
    import torch.distributed as dist

    def wrap(name, position, keyword, sent):
        original = getattr(dist, name, None)
        if original is None:
            return

        def counted(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs[keyword]
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            counter[name] += sent(tensor.numel() * tensor.element_size(), size)
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_reduce", 0, "tensor", lambda b, n: 2 * (n - 1) / n * b)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, 1, "input_tensor", lambda b, n: (n - 1) * b)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        wrap(name, 1, "input", lambda b, n: (n - 1) / n * b)
    wrap("broadcast", 0, "tensor", lambda b, n: b)
    wrap("send", 0, "tensor", lambda b, n: b)
    wrap("isend", 0, "tensor", lambda b, n: b)


def worker(args: argparse.Namespace) -> None:
    counter: dict = defaultdict(float)
    _count_bytes(counter)
    import torch

    from llama_megatron.config import ModelConfig, ParallelConfig
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.parallel.launch import init_distributed
    from llama_megatron.training.batches import build_datasets, step_batches
    from llama_megatron.training.config import BatchConfig, TrainingConfig
    from llama_megatron.training.deepspeed_config import build_deepspeed_config
    from llama_megatron.training.engine import TrainingEngine

    init_distributed()
    config = TrainingConfig(
        model=ModelConfig(**MODEL),
        parallel=ParallelConfig(tensor=args.tp, pipeline=args.pp, sequence_parallel=args.sp),
        seq_length=SEQ, batch=BatchConfig(1, args.micro_batches),
    )
    config.train.steps = args.steps + 1
    world = int(os.environ["WORLD_SIZE"])
    ds = build_deepspeed_config(config, {"zero_optimization": {"stage": 0}}, world)
    pctx = ParallelContext.build(args.tp, args.pp, args.sp)
    engine = TrainingEngine(config, ds, pctx)
    train, _, _ = build_datasets(config)
    batches = list(step_batches(train, config, pctx, 0, args.steps + 1))
    engine.train_step(batches[0])  # warm-up, not counted
    counter.clear()
    start = time.perf_counter()
    for step in batches[1:]:
        engine.train_step(step)
    elapsed = (time.perf_counter() - start) / args.steps
    per_step = {k: v / args.steps for k, v in counter.items() if v}
    ranks: list = [None] * pctx.world_size
    torch.distributed.all_gather_object(ranks, {"stage": pctx.pp_rank, "bytes_per_step": per_step})
    if pctx.rank == 0:
        per_micro = args.micro_batches

        def sent_by(stage: int) -> float:  # mean p2p bytes per micro batch of the ranks on ``stage``
            on_stage = [sum(r["bytes_per_step"].get(k, 0.0) for k in SENDS) for r in ranks if r["stage"] == stage]
            return sum(on_stage) / len(on_stage) / per_micro

        pipe = {"forward": sent_by(0), "backward": sent_by(args.pp - 1)} if args.pp > 1 else None
        with open(args.result, "w") as fh:
            json.dump({"step_s": elapsed, "bytes_per_step": per_step, "pipe_bytes_per_micro_batch": pipe}, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def analytic(cfg: dict) -> dict:
    b, s, h, layers = 1, SEQ, MODEL["hidden_size"], MODEL["num_hidden_layers"]
    t, p, m = cfg["tp"], cfg["pp"], cfg["micro_batches"]
    activation = b * s * h * 4  # fp32 bytes
    per_layer = 4 * 2 * (t - 1) / t * activation if t > 1 else 0.0
    out = {
        "tp_bytes_per_layer_per_micro_batch": per_layer,
        "tp_bytes_per_step": per_layer * layers // p * m,
        "pipeline_bubble": (p - 1) / (m + p - 1),
    }
    if p > 1:
        out["pipe_bytes_per_micro_batch"] = {"forward": activation / t + b * s * 8, "backward": activation / t}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--result", default=None)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    baseline: dict[int, float] = {}
    for cfg in CONFIGS:
        with tempfile.TemporaryDirectory() as tmp:
            result_path = os.path.join(tmp, "result.json")
            cmd = [launcher, "--num_gpus", str(cfg["tp"] * cfg["pp"]), "--master_port", str(29500 + os.getpid() % 1000),
                   os.path.abspath(__file__), "--worker", "--tp", str(cfg["tp"]), "--pp", str(cfg["pp"]),
                   "--micro-batches", str(cfg["micro_batches"]), "--steps", str(args.steps), "--result", result_path]
            if cfg["sp"]:
                cmd.append("--sp")
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // (cfg["tp"] * cfg["pp"]))))
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            with open(result_path) as fh:
                measured = json.load(fh)
        theory = analytic(cfg)
        tp_measured = sum(v for k, v in measured["bytes_per_step"].items() if k in TP_COLLECTIVES)
        layers_per_stage = MODEL["num_hidden_layers"] // cfg["pp"]
        line = {
            "benchmark": "parallel_overhead", **cfg, "seq": SEQ, "hidden": MODEL["hidden_size"],
            "layers": MODEL["num_hidden_layers"], "step_s": round(measured["step_s"], 4),
            "tokens_per_s": round(cfg["micro_batches"] * SEQ / measured["step_s"], 1),
            "measured_bytes_per_step": {k: int(v) for k, v in measured["bytes_per_step"].items()},
            "measured_collective_bytes_per_layer_per_micro_batch":
                int(tp_measured / layers_per_stage / cfg["micro_batches"]) if cfg["tp"] > 1 else 0,
            "analytic": theory,
        }
        if measured["pipe_bytes_per_micro_batch"]:
            line["measured_pipe_bytes_per_micro_batch"] = {
                k: int(v) for k, v in measured["pipe_bytes_per_micro_batch"].items()}
        if cfg["pp"] == 1 and cfg["tp"] == 1:
            baseline[1] = measured["step_s"]
        if cfg["pp"] > 1 and cfg["tp"] == 1 and 1 in baseline:
            # ideal PP step time on p stages = m * (PP=1 time per micro batch) / p; the excess is the bubble
            ideal = cfg["micro_batches"] * baseline[1] / cfg["pp"]
            line["measured_bubble"] = round(max(0.0, 1 - ideal / measured["step_s"]), 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
