"""Per-step time and communicated bytes of TP / SP / PP / CP layouts, next to Megatron's analytic figures.

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
  SP each rank sends its own sequence shard, the same bytes, and no all-gather is needed;
- with context parallelism (Ulysses), the all-to-all bytes per decoder layer per micro batch: q, k, v and the
  output forward and their gradients backward, each all-to-all sending (c-1)/c of a [b, s/c, heads/t, d] tensor
  (k and v: kv_heads/t x r heads, r the KV repeats when the KV heads do not split over c).

    python benchmarks/parallel_overhead.py                 # all configurations (a few minutes on CPU)
    python benchmarks/parallel_overhead.py --only cp       # the configurations whose name contains "cp"
    python benchmarks/parallel_overhead.py --schedules       # the four schedules, PP2/PP4 x 1..16 micro batches
    python benchmarks/parallel_overhead.py --schedules --schedule-hidden 1024 --schedule-stages 4 \
        --schedule-micro-batches 8                         # the PP4 x 8 point where W costs what B does
    python benchmarks/parallel_overhead.py --context-scaling --seq 32768 --model configs/models/llama-50m.json \
        --bf16 --recompute                                 # GPUs: tokens/s per device, CP 1 (unsharded) vs CP 2
    python benchmarks/parallel_overhead.py --experts         # MoE on 2 ranks: EP 1 (DP 2) vs EP 2, tokens/s and
                                                           # the token all-to-all's bytes per layer

With ``--experts`` (a mixture-of-experts model, 8 experts, top 2) both runs use 2 ranks and the same global batch:
EP 1 replicates the experts (DP 2), EP 2 splits them. The all-to-all bytes are counted exactly (the rows each rank
sends to the other EP ranks); the analytic volume assumes balanced routing: per layer and micro batch 4 exchanges
(dispatch and combine, forward and backward) of (EP - 1) / EP of the rank's k x tokens rows of h values.
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

from llama_megatron.parallel.placement import available_cores, launcher_command  # noqa: E402
from llama_megatron.training.pipeline.schedules import SCHEDULES  # noqa: E402

MODEL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 1024}
SEQ = 256
MOE_MODEL = {**MODEL, "model_type": "mixtral", "intermediate_size": 344, "num_local_experts": 8,
             "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.02}


def schedule_model(hidden: int) -> dict:
    """``--schedules``' model: 2 decoder layers per stage at PP4 and a small vocabulary, so the head and loss of the
    last stage cost about what the first stage's embedding and layers do (unequal stages idle under any schedule).
    The larger ``hidden``, the more matrix products dominate the backward pass and the closer W's cost comes to B's
    (on this CPU: 1/2 of it at 256, 3/4 at 512, all of it at 1024)."""
    return {**MODEL, "hidden_size": hidden, "intermediate_size": hidden * 43 // 16, "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 64, "vocab_size": 512, "num_hidden_layers": 8}


CONFIGS = [
    {"tp": 1, "pp": 1, "sp": False, "micro_batches": 1},
    {"tp": 2, "pp": 1, "sp": False, "micro_batches": 1},
    {"tp": 2, "pp": 1, "sp": True, "micro_batches": 1},
    *({"tp": 1, "pp": 2, "sp": False, "micro_batches": m} for m in (1, 2, 4, 8)),
    {"tp": 2, "pp": 2, "sp": False, "micro_batches": 4},
    {"tp": 2, "pp": 2, "sp": True, "micro_batches": 4},
    {"tp": 1, "pp": 1, "cp": 2, "sp": False, "micro_batches": 1},
    {"tp": 2, "pp": 1, "cp": 2, "sp": True, "micro_batches": 1},
    {"tp": 2, "pp": 1, "cp": 2, "sp": True, "micro_batches": 1, "kv_heads": 2},  # 1 KV head per TP rank, repeated
]
# measured bytes are keyed "collective[group]", the group being tp, cp, dp_cp (DeepSpeed's data-parallel group:
# gradients), pp, or other (DeepSpeed's pipeline grid, the world)
TP_COLLECTIVES = ("all_reduce[tp]", "all_gather_single[tp]", "reduce_scatter_single[tp]")  # the model's TP layers
CP_COLLECTIVES = ("all_to_all_single[cp]",)  # DeepSpeed-Ulysses' all-to-all (deepspeed.comm calls torch's)
EP_COLLECTIVES = ("all_to_all_single[ep]",)  # the MoE token exchange (and its per-expert counts)
SENDS = ("send[other]", "isend[other]")


def _count_bytes(counter: dict) -> None:
    """Wrap torch.distributed's collectives so every call adds the bytes this rank sends, keyed (name, group)."""
    import torch.distributed as dist

    def wrap(name, position, keyword, sent):
        original = getattr(dist, name, None)
        if original is None:
            return

        def counted(*args, **kwargs):
            tensor = args[position] if len(args) > position else kwargs[keyword]
            group = kwargs.get("group")
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            counter[(name, id(group))] += sent(tensor.numel() * tensor.element_size(), size)
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_reduce", 0, "tensor", lambda b, n: 2 * (n - 1) / n * b)
    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, 1, "input_tensor", lambda b, n: (n - 1) * b)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        wrap(name, 1, "input", lambda b, n: (n - 1) / n * b)
    original_all_to_all = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        total = input.numel() * input.element_size()
        if input_split_sizes:  # uneven (the MoE exchange): exactly the rows that leave this rank
            mine = input_split_sizes[dist.get_rank(group) if group is not None else dist.get_rank()]
            sent = total * (1 - mine / max(1, sum(input_split_sizes)))
        else:  # each rank keeps 1/n of its input
            sent = (size - 1) / size * total
        counter[("all_to_all_single", id(group))] += sent
        return original_all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    dist.all_to_all_single = all_to_all_single
    wrap("broadcast", 0, "tensor", lambda b, n: b)
    wrap("send", 0, "tensor", lambda b, n: b)
    wrap("isend", 0, "tensor", lambda b, n: b)


def _model(args: argparse.Namespace) -> dict:
    if args.model:
        with open(args.model) as fh:
            return json.load(fh)
    base = MOE_MODEL if args.experts else MODEL
    return {**base, "num_key_value_heads": args.kv_heads or base["num_key_value_heads"]}


def _training_config(args: argparse.Namespace, world: int):
    """The worker's training config and DeepSpeed config (ZeRO-0; fp32 unless ``--bf16``)."""
    from llama_megatron.config import ModelConfig
    from llama_megatron.parallel.degrees import ParallelConfig
    from llama_megatron.training.config import BatchConfig, TrainingConfig
    from llama_megatron.training.engine.deepspeed_config import build_deepspeed_config

    dp = world // (args.tp * args.pp * args.cp)
    config = TrainingConfig(
        model=ModelConfig.from_dict(_model(args)),
        parallel=ParallelConfig(tensor=args.tp, pipeline=args.pp, context=args.cp, expert=args.ep,
                                sequence_parallel=args.sp),
        seq_length=args.seq, batch=BatchConfig(1, args.micro_batches * dp),
    )
    config.train.steps = args.steps + 1
    config.activation_checkpointing.interval = int(args.recompute)
    config.pipeline.schedule = args.schedule
    config.pipeline.virtual_stages = _chunks(args.schedule)
    ds = build_deepspeed_config(config, {"zero_optimization": {"stage": 0}, "bf16": {"enabled": args.bf16}}, world)
    return config, ds


def worker(args: argparse.Namespace) -> None:
    """One launch: each run of ``--runs`` (a JSON list of argument overrides, e.g. ``[{"schedule": "zb-h1"}]``)
    measured in turn, each on an engine of its own (a launch per run would add the launcher's and the imports'
    start-up to each); rank 0 writes the results, in that order."""
    counter: dict = defaultdict(float)
    _count_bytes(counter)
    import torch

    from llama_megatron.parallel.process_groups import init_distributed

    init_distributed()
    results = [_measure(argparse.Namespace(**{**vars(args), **run}), counter) for run in json.loads(args.runs)]
    if torch.distributed.get_rank() == 0:
        with open(args.result, "w") as fh:
            json.dump(results, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _measure(args: argparse.Namespace, counter: dict) -> dict | None:
    """One run's engine, a warm-up step, then the timed steps; rank 0's result (None on the other ranks)."""
    import gc

    import torch

    from llama_megatron.model.build import build_model
    from llama_megatron.model.kernels import resolve_kernels
    from llama_megatron.parallel.context import ParallelContext
    from llama_megatron.training.engine.training_engine import TrainingEngine
    from llama_megatron.training.run.batches import build_datasets, step_batches

    config, ds = _training_config(args, int(os.environ["WORLD_SIZE"]))
    pctx = ParallelContext.build(config.parallel)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(config.model, config.parallel, pctx, activation_checkpoint_interval=int(args.recompute),
                        kernels=resolve_kernels(config.kernels, device),
                        placement=config.pipeline.placement(args.pp))
    engine = TrainingEngine(config, ds, pctx, model)
    train, _, _ = build_datasets(config)
    batches = list(step_batches(train, config, pctx, 0, args.steps + 1))
    engine.train_step(batches[0])  # warm-up, not counted
    counter.clear()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    if args.timeline:
        result = _timed_steps(args, engine, batches[1:], pctx, counter)
    else:
        result = _bytes_and_time(args, engine, batches[1:], pctx, counter)
    del engine, model
    gc.collect()
    return result


def _bytes_and_time(args: argparse.Namespace, engine, batches: list, pctx, counter: dict) -> dict | None:
    import torch

    start = time.perf_counter()
    for step in batches:
        engine.train_step(step)
    elapsed = (time.perf_counter() - start) / args.steps
    groups = {id(pctx.tp_group): "tp", id(pctx.pp_group): "pp", id(pctx.dp_cp_group): "dp_cp"}
    if pctx.cp_group is not None:
        groups[id(pctx.cp_group)] = "cp"
    if pctx.ep_group is not None:
        groups[id(pctx.ep_group)] = "ep"
    per_step: dict = defaultdict(float)
    for (name, group), sent in counter.items():
        if sent:
            per_step[f"{name}[{groups.get(group, 'other')}]"] += sent / args.steps
    ranks: list = [None] * pctx.world_size
    torch.distributed.all_gather_object(ranks, {"stage": pctx.pp_rank, "bytes_per_step": per_step})
    if pctx.rank != 0:
        return None
    per_micro = args.micro_batches

    def sent_by(stage: int) -> float:  # mean p2p bytes per micro batch of the ranks on ``stage``
        on_stage = [sum(r["bytes_per_step"].get(k, 0.0) for k in SENDS) for r in ranks if r["stage"] == stage]
        return sum(on_stage) / len(on_stage) / per_micro

    pipe = {"forward": sent_by(0), "backward": sent_by(args.pp - 1)} if args.pp > 1 else None
    memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {"step_s": elapsed, "bytes_per_step": per_step, "pipe_bytes_per_micro_batch": pipe,
            "peak_memory_bytes": memory}


def _timed_steps(args: argparse.Namespace, engine, batches: list, pctx, counter: dict) -> dict | None:
    """``--timeline``: every instruction of every stage timed and each stage's activation bytes after it; rank 0
    returns per stage busy/idle (the mean over the steps), the mean pass times, the activation peaks and the bytes
    each stage sends to the others per step."""
    import torch

    from llama_megatron.training.pipeline.timeline import (
        ActivationMeter,
        InstructionTimeline,
        bubble,
        pipeline_buffers,
    )

    ds_engine = engine.engine
    meter = ActivationMeter(ds_engine.module, getattr(ds_engine, "weight_grads", None),
                            lambda: pipeline_buffers(ds_engine))
    timeline = InstructionTimeline(ds_engine, meter)
    steps, elapsed, metering = [], 0.0, []
    for step in batches:
        timeline.clear()
        start = time.perf_counter()
        with meter.recording():
            engine.train_step(step)
        elapsed += time.perf_counter() - start
        stages: list = [None] * pctx.world_size
        torch.distributed.all_gather_object(stages, (pctx.pp_rank, list(timeline.records), meter.peak))
        metering.append(timeline.metering)
        steps.append(stages)
    metered: list = [None] * pctx.world_size  # seconds a step spent sampling the activation meter, per rank
    torch.distributed.all_gather_object(metered, (pctx.pp_rank, sum(metering) / len(metering)))
    sent: list = [None] * pctx.world_size  # point-to-point bytes of this rank per step (headers included)
    torch.distributed.all_gather_object(sent, sum(v for (name, _), v in counter.items() if name in ("send", "isend"))
                                        / len(batches))
    if pctx.rank != 0:
        return None
    # with TP1 x PP only, rank i is stage i
    ordered = [sorted(stages, key=lambda r: r[0]) for stages in steps]
    summaries = [bubble([records for _, records, _ in stages]) for stages in ordered]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"step_s": elapsed / len(batches),
            "span_s": mean([s["span_s"] for s in summaries]),
            "busy_s": [mean([s["busy_s"][i] for s in summaries]) for i in range(args.pp)],
            "idle_s": [mean([s["idle_s"][i] for s in summaries]) for i in range(args.pp)],
            "idle_share": mean([s["idle_share"] for s in summaries]),
            "pass_s": {k: mean([s["pass_s"][k] for s in summaries]) for k in summaries[0]["pass_s"]},
            "activation_peak_bytes": [max(stages[i][2] for stages in ordered) for i in range(args.pp)],
            "sent_bytes_per_step": sent,
            "metering_s": [m for _, m in sorted(metered)],
            # seconds per step in each kind of instruction, per stage (receives include their waits)
            "instruction_s": [{name: round(mean([sum(r[3] - r[2] for r in stages[i][1] if r[0] == name)
                                                for stages in ordered]), 4)
                               for name in sorted({r[0] for r in ordered[0][i][1]})} for i in range(args.pp)]}



def _chunks(schedule: str) -> int:  # --schedules runs the virtual-stage schedules at v = 2
    return SCHEDULES[schedule].default_chunks()


def schedules(args: argparse.Namespace) -> None:
    """``--schedules``: 1F1B, ZB-H1, interleaved 1F1B and ZB-V (v = 2) at PP2 and PP4 with 1..16 micro batches (those
    each schedule runs), each stage's instructions timed: measured busy and idle per stage, tokens/s, activation
    peaks per stage next to ``estimate``'s, bytes sent per step, next to the analytic bubbles and a replay of every
    order with the measured pass times (training/pipeline/schedules.simulate)."""
    from llama_megatron.training.diagnostics.memory_estimate import estimate
    from llama_megatron.training.pipeline.schedules import analytic_bubble, micro_batch_rule, simulate

    if not args.model:
        args.model = os.path.join(tempfile.mkdtemp(), "model.json")
        with open(args.model, "w", encoding="utf-8") as fh:
            json.dump(schedule_model(args.schedule_hidden), fh)
    model = _model(args)
    for pp in args.schedule_stages:
        for m in args.schedule_micro_batches:
            names = [n for n in args.schedule_names
                     if micro_batch_rule(n, pp, _chunks(n), m) is None]
            cfg = {"tp": 1, "pp": pp, "sp": False, "micro_batches": m}
            measured = dict(zip(names, _launch_runs(cfg, args, [{"schedule": n} for n in names], timeline=True)))
            line = {"benchmark": "pipeline_schedules", "pp": pp, "micro_batches": m, "seq": args.seq,
                    "hidden": model["hidden_size"], "layers": model["num_hidden_layers"],
                    "analytic_idle_share": {name: round(analytic_bubble(name, pp, m, _chunks(name)), 3)
                                            for name in names}}
            if "zb-h1" in measured:  # a whole stage's F, B and W, measured under ZB-H1: every order replayed
                costs = measured["zb-h1"]["pass_s"]
                forward, b, w = costs["ChunkForward"], costs["ChunkBackwardInput"], costs["ChunkWeight"]
                line["replayed_idle_share_with_measured_passes"] = {
                    name: round(simulate(name, pp, m, _chunks(name), forward, b, w)["idle_share"], 3)
                    for name in names}
            for name, result in measured.items():
                config, ds = _training_config(argparse.Namespace(**{**vars(args), "tp": 1, "pp": pp, "cp": 1,
                                                                    "sp": False, "micro_batches": m,
                                                                    "schedule": name}), pp)
                config.kernels = "reference"  # what ran here (the estimate's default is a GPU's kernels)
                stages = estimate(config, ds, pp).stages
                line[name] = {"idle_share": round(result["idle_share"], 3),
                              "tokens_per_s": round(m * args.seq / result["step_s"], 1),
                              "step_s": round(result["step_s"], 4), "span_s": round(result["span_s"], 4),
                              "busy_s": [round(x, 4) for x in result["busy_s"]],
                              "idle_s": [round(x, 4) for x in result["idle_s"]],
                              "pass_s": {k: round(v, 5) for k, v in result["pass_s"].items()},
                              "activation_peak_mib": [round(x / 2**20, 2) for x in result["activation_peak_bytes"]],
                              "estimate_activation_mib": [round(st.activations / 2**20, 2) for st in stages],
                              "sent_mib_per_step": round(sum(result["sent_bytes_per_step"]) / 2**20, 3),
                              "metering_s": [round(x, 4) for x in result["metering_s"]],
                              "instruction_s": result["instruction_s"]}
            for name in names[1:]:
                if "1f1b" in measured:
                    line[f"{name}_over_1f1b"] = {
                        "idle_share": round(line[name]["idle_share"] / line["1f1b"]["idle_share"], 3),
                        "tokens_per_s": round(line[name]["tokens_per_s"] / line["1f1b"]["tokens_per_s"], 3),
                        "sent_bytes": round(line[name]["sent_mib_per_step"] / line["1f1b"]["sent_mib_per_step"], 3)}
            print(json.dumps(line), flush=True)


def analytic(cfg: dict, seq: int = SEQ, model: dict = MODEL) -> dict:
    b, s, h, layers = 1, seq, model["hidden_size"], model["num_hidden_layers"]
    t, p, m, c = cfg["tp"], cfg["pp"], cfg["micro_batches"], cfg.get("cp", 1)
    activation = b * s // c * h * 4  # fp32 bytes of a rank's [b, s/c, h] activation
    per_layer = 4 * 2 * (t - 1) / t * activation if t > 1 else 0.0
    out = {
        "tp_bytes_per_layer_per_micro_batch": per_layer,
        "tp_bytes_per_step": per_layer * layers // p * m,
        "pipeline_bubble": (p - 1) / (m + p - 1),
    }
    if p > 1:
        out["pipe_bytes_per_micro_batch"] = {"forward": activation / t + b * s * 8, "backward": activation / t}
    if c > 1:
        out["cp_all_to_all_bytes_per_layer_per_micro_batch"] = ulysses_bytes_per_layer(cfg, seq, model)
    return out


def ulysses_bytes_per_layer(cfg: dict, seq: int = SEQ, model: dict = MODEL) -> float:
    """Bytes one rank sends in a decoder layer's all-to-alls, forward and backward, one micro batch (fp32)."""
    from llama_megatron.parallel.degrees import kv_head_repeats

    t, c = cfg["tp"], cfg["cp"]
    heads = model["num_attention_heads"] // t
    kv = (cfg.get("kv_heads") or model["num_key_value_heads"]) // t
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    tensor = seq // c * head_dim * 4  # one head of the rank's b=1 x s/c tokens
    per_pass = (2 * heads + 2 * kv * kv_head_repeats(kv, c)) * tensor  # q and the output, k and v
    return 2 * (c - 1) / c * per_pass  # forward and backward, each rank keeping 1/c


def _launch(cfg: dict, args: argparse.Namespace) -> dict:
    """Run the worker for ``cfg`` under the deepspeed launcher; its measurements."""
    return _launch_runs(cfg, args, [{}])[0]


def _launch_runs(cfg: dict, args: argparse.Namespace, runs: list[dict], timeline: bool = False) -> list[dict]:
    """Run the worker for ``cfg`` under the deepspeed launcher, once per entry of ``runs`` (the worker's argument
    overrides: schedule, ep) in one launch; the measurements, in that order."""
    ranks = cfg["tp"] * cfg["pp"] * cfg.get("cp", 1) * cfg.get("dp", 1)
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd = [*launcher_command(ranks), os.path.abspath(__file__), "--worker", "--tp", str(cfg["tp"]), "--pp",
               str(cfg["pp"]), "--cp", str(cfg.get("cp", 1)), "--micro-batches", str(cfg["micro_batches"]), "--steps",
               str(args.steps), "--seq", str(args.seq), "--result", result_path, "--runs", json.dumps(runs),
               "--ep", str(cfg.get("ep", 1))]  # a run's "ep" overrides this
        if timeline:
            cmd.append("--timeline")
        if cfg.get("kv_heads"):
            cmd += ["--kv-heads", str(cfg["kv_heads"])]
        for flag in ("sp", "bf16", "recompute", "experts"):
            if cfg.get(flag) or getattr(args, flag, False):
                cmd.append(f"--{flag}")
        if args.model:
            cmd += ["--model", os.path.abspath(args.model)]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, available_cores() // ranks)))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(result_path) as fh:
            return json.load(fh)


def _name(cfg: dict) -> str:
    name = f"tp{cfg['tp']}-pp{cfg['pp']}" + (f"-cp{cfg['cp']}" if cfg.get("cp", 1) > 1 else "")
    return name + ("-sp" if cfg["sp"] else "") + (f"-kv{cfg['kv_heads']}" if cfg.get("kv_heads") else "")


def context_scaling(args: argparse.Namespace) -> None:
    """Tokens/s per device at ``--seq`` tokens: the unsharded run (one device) next to CP 2 (two devices)."""
    for cp in (1, 2):
        cfg = {"tp": 1, "pp": 1, "cp": cp, "sp": False, "micro_batches": 1}
        measured = _launch(cfg, args)
        line = {"benchmark": "context_scaling", "cp": cp, "devices": cp, "seq": args.seq, "model": args.model,
                "bf16": args.bf16, "recompute": args.recompute, "step_s": round(measured["step_s"], 4),
                "tokens_per_s_per_device": round(args.seq / measured["step_s"] / cp, 1),
                "peak_memory_gib": (round(measured["peak_memory_bytes"] / 2**30, 2)
                                    if measured["peak_memory_bytes"] else None)}
        print(json.dumps(line), flush=True)


def expert_bytes_per_layer(cfg: dict, seq: int, model: dict) -> float:
    """Analytic bytes one rank sends in an MoE layer's all-to-alls per micro batch (fp32, balanced routing)."""
    ep, rows = cfg["ep"], seq * model["num_experts_per_tok"]  # b = 1
    return 4 * (ep - 1) / ep * rows * model["hidden_size"] * 4


def experts(args: argparse.Namespace) -> None:
    """MoE on 2 ranks with the same global batch: EP 1 (DP 2, experts replicated) vs EP 2."""
    model = _model(args)
    tokens_per_s = {}
    cfg = {"tp": 1, "pp": 1, "sp": False, "dp": 2, "micro_batches": args.micro_batches}
    for ep, measured in zip((1, 2), _launch_runs(cfg, args, [{"ep": 1}, {"ep": 2}])):
        cfg["ep"] = ep
        tokens_per_s[ep] = 2 * cfg["micro_batches"] * args.seq / measured["step_s"]
        a2a = sum(v for k, v in measured["bytes_per_step"].items() if k in EP_COLLECTIVES)
        line = {"benchmark": "expert_parallel", "ep": ep, "ranks": 2, "seq": args.seq, "hidden": model["hidden_size"],
                "experts": model["num_local_experts"], "top_k": model["num_experts_per_tok"],
                "step_s": round(measured["step_s"], 4), "tokens_per_s": round(tokens_per_s[ep], 1),
                "measured_bytes_per_step": {k: int(v) for k, v in measured["bytes_per_step"].items()}}
        if ep > 1:
            line["measured_ep_all_to_all_bytes_per_layer_per_micro_batch"] = int(
                a2a / model["num_hidden_layers"] / cfg["micro_batches"])
            line["analytic_ep_all_to_all_bytes_per_layer_per_micro_batch"] = int(
                expert_bytes_per_layer(cfg, args.seq, model))
            line["tokens_per_s_vs_ep1"] = round(tokens_per_s[ep] / tokens_per_s[1], 3)
        print(json.dumps(line), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--experts", action="store_true",
                        help="an MoE model on 2 ranks: EP 1 vs EP 2, tokens/s and all-to-all bytes per layer")
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=SEQ, help=f"tokens per sample (default {SEQ})")
    parser.add_argument("--only", default=None, help="run the configurations whose name contains this")
    parser.add_argument("--context-scaling", action="store_true",
                        help="tokens/s per device of CP 1 vs CP 2 at --seq (for GPUs; runs on CPU too)")
    parser.add_argument("--model", default=None, help="a model config JSON (default: the built-in benchmark model)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing of every layer")
    parser.add_argument("--schedules", action="store_true",
                        help="1F1B vs ZB-H1: per-stage busy/idle time, tokens/s and activation peaks")
    parser.add_argument("--schedule-stages", type=int, nargs="+", default=[2, 4], help="with --schedules")
    parser.add_argument("--schedule-hidden", type=int, default=512,
                        help="with --schedules: the 8-layer model's hidden size (default 512; 1024: W costs what B does)")
    parser.add_argument("--schedule-micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="with --schedules")
    parser.add_argument("--schedule-names", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES),
                        help="with --schedules: which schedules (default: all four)")
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--runs", default="[{}]", help=argparse.SUPPRESS)
    parser.add_argument("--timeline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.context_scaling:
        context_scaling(args)
        return
    if args.experts:
        experts(args)
        return
    if args.schedules:
        schedules(args)
        return
    baseline: dict[int, float] = {}
    for cfg in CONFIGS:
        if args.only and args.only not in _name(cfg):
            continue
        measured = _launch(cfg, args)
        model = _model(args)
        theory = analytic(cfg, args.seq, model)
        tp_measured = sum(v for k, v in measured["bytes_per_step"].items() if k in TP_COLLECTIVES)
        layers_per_stage = model["num_hidden_layers"] // cfg["pp"]
        line = {
            "benchmark": "parallel_overhead", "name": _name(cfg), **cfg, "seq": args.seq,
            "hidden": model["hidden_size"], "layers": model["num_hidden_layers"],
            "step_s": round(measured["step_s"], 4),
            "tokens_per_s": round(cfg["micro_batches"] * args.seq / measured["step_s"], 1),
            "measured_bytes_per_step": {k: int(v) for k, v in measured["bytes_per_step"].items()},
            "measured_collective_bytes_per_layer_per_micro_batch":
                int(tp_measured / layers_per_stage / cfg["micro_batches"]) if cfg["tp"] > 1 else 0,
            "analytic": theory,
        }
        if cfg.get("cp", 1) > 1:
            a2a = sum(v for k, v in measured["bytes_per_step"].items() if k in CP_COLLECTIVES)
            line["measured_cp_all_to_all_bytes_per_layer_per_micro_batch"] = (
                a2a / layers_per_stage / cfg["micro_batches"])
        if measured["pipe_bytes_per_micro_batch"]:
            line["measured_pipe_bytes_per_micro_batch"] = {
                k: int(v) for k, v in measured["pipe_bytes_per_micro_batch"].items()}
        if cfg["pp"] == 1 and cfg["tp"] == 1 and cfg.get("cp", 1) == 1:
            baseline[1] = measured["step_s"]
        if cfg["pp"] > 1 and cfg["tp"] == 1 and 1 in baseline:
            # ideal PP step time on p stages = m * (PP=1 time per micro batch) / p; the excess is the bubble
            ideal = cfg["micro_batches"] * baseline[1] / cfg["pp"]
            line["measured_bubble"] = round(max(0.0, 1 - ideal / measured["step_s"]), 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
