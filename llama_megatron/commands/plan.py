"""``llama-megatron plan``: the parallel layouts of a model on a cluster, ranked by predicted tokens/s per GPU.

    llama-megatron plan --model llama3-70b --gpus 64 --device h100-sxm --seq-length 8192 --global-batch-size 128
    llama-megatron plan --config configs/pretrain/llama3-8b-4node.json --gpus 32 --device h200 --write best.json
    llama-megatron plan --model llama3-8b --gpus 8 --device h100-sxm --layout tp=1,pp=1,zero=3,mbs=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from llama_megatron.config import read_json
from llama_megatron.errors import ConfigError
from llama_megatron.model.kernels import KERNEL_CHOICES
from llama_megatron.progress import TaskProgress
from llama_megatron.training.diagnostics.deepspeed_memory import bucket_note
from llama_megatron.training.planner.devices import UNIT_PROFILE, device_names, load_device
from llama_megatron.training.planner.search import GiB, Layout, Planned, Planner, Refused, write_layout

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                          "models")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("the run")
    what.add_argument("--model", help="a preset of configs/models (llama3-70b, ...), a model JSON or an HF directory")
    what.add_argument("--config", help="a training JSON: model, sequence, batch (and the rest of what --write writes)")
    what.add_argument("--seq-length", type=int, help="tokens per sample (default: the config's, else 4096)")
    what.add_argument("--global-batch-size", type=int, help="samples per step (default: the config's, else 512)")
    what.add_argument("--kernels", choices=KERNEL_CHOICES,
                      help="the training config's kernels (default: the config's, else auto: compiled on GPUs); "
                           "reference costs the eager operators' memory traffic")
    where = parser.add_argument_group("the cluster")
    where.add_argument("--gpus", type=int, help="GPUs in all")
    where.add_argument("--gpus-per-node", type=int, help="default: the device profile's")
    where.add_argument("--device", default="h100-sxm", help=f"a profile of configs/devices: {', '.join(device_names())}")
    where.add_argument("--device-file", help="a device profile JSON of your own (plan --calibrate writes one)")
    search = parser.add_argument_group("the search")
    search.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                        help="the GEMMs' precision (fp8: the device's fp8 rate, the float8 operands counted, "
                             "and an fp8 section (the config's, else tensorwise) in what --write writes; the states "
                             "stay bf16)")
    search.add_argument("--schedules", nargs="+", metavar="NAME", help="pipeline schedules to try (default: all)")
    search.add_argument("--max-micro-batch", type=int, default=8, help="largest micro batch tried (default 8)")
    search.add_argument("--tp-across-nodes", action="store_true", help="allow a TP group to span nodes")
    search.add_argument("--memory-margin", type=float, default=0.05,
                        help="share of the device memory kept free (allocator, CUDA context; default 0.05)")
    search.add_argument("--layout", help="evaluate one layout: tp=4,pp=8,vp=5,cp=1,ep=1,mbs=1,"
                                         "schedule=interleaved-1f1b,zero=1,recompute=1,sp=0,offload=1")
    measure = parser.add_argument_group("measuring this machine")
    measure.add_argument("--calibrate", action="store_true",
                         help="measure GEMMs, attention, memory and all-reduce between --nproc local processes and "
                              "write a device profile (--output); plan with it through --device-file. With --model "
                              "or --config it also times every GEMM of that model's layouts on --nproc ranks")
    measure.add_argument("--nproc", type=int, default=2, help="processes (ranks) the calibration measures (default 2)")
    measure.add_argument("--output", default="runs/devices/cpu.json", help="where --calibrate writes the profile")
    out = parser.add_argument_group("the output")
    out.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    out.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    out.add_argument("--write", metavar="PATH", help="write the best layout as a training JSON (and its DeepSpeed "
                                                      "JSON beside it) that train accepts as it is")


def _model_path(name: str) -> str:
    if os.path.exists(name):
        return name
    preset = os.path.join(MODELS_DIR, f"{name}.json")
    if os.path.isfile(preset):
        return preset
    names = sorted(f[:-5] for f in os.listdir(MODELS_DIR) if f.endswith(".json"))
    raise ConfigError(f"--model {name!r}: neither a path nor a preset ({', '.join(names)})")


def base_config(args: argparse.Namespace) -> dict:
    """The training JSON the layouts are written into: --config's, or a synthetic-data run of --model."""
    if (args.model is None) == (args.config is None):
        raise ConfigError("plan needs --model or --config (one of them)")
    if args.config is not None:
        base = read_json(args.config, "training config")
    else:
        base = {"model": _model_path(args.model), "data": {"type": "synthetic"}, "seq_length": 4096,
                "batch": {"micro_batch_size": 1, "global_batch_size": 512}, "kernels": "auto"}
    if args.seq_length is not None:
        base["seq_length"] = args.seq_length
    if args.global_batch_size is not None:
        base["batch"] = {**base.get("batch", {}), "global_batch_size": args.global_batch_size}
    if args.kernels is not None:
        base["kernels"] = args.kernels
    return base


def _check(args: argparse.Namespace) -> None:
    if args.gpus is None:
        raise ConfigError("plan needs --gpus N (or --calibrate)")
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus_per_node is not None and (args.gpus_per_node < 1 or args.gpus % min(args.gpus, args.gpus_per_node)):
        raise ConfigError(f"--gpus {args.gpus} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}")
    if not 0 <= args.memory_margin < 1:
        raise ConfigError(f"--memory-margin must be in [0, 1), got {args.memory_margin}")


def _row(rank: int | str, planned: Planned, gpus: int) -> str:
    t, worst = planned.time, max(planned.memory.stages, key=lambda s: s.gpu_total)
    return (f"{rank!s:>4}  {planned.layout.label(gpus):44} {worst.gpu_total / GiB:8.1f} {t.step:9.3f} "
            f"{t.tokens_per_s_per_gpu:10.0f} {100 * t.mfu:6.1f} {100 * t.idle_share:6.1f} {100 * t.comm_share:6.1f}")


HEADER = f"{'':>4}  {'layout':44} {'peak GiB':>8} {'step s':>9} {'tok/s/GPU':>10} {'MFU %':>6} {'idle %':>6} {'comm %':>6}"


def _record(planned: Planned, gpus: int) -> dict:
    t = planned.time
    return {"layout": planned.layout.__dict__, "label": planned.layout.label(gpus),
            "data_parallel": planned.layout.dp(gpus),
            "peak_bytes_per_stage": [s.gpu_total for s in planned.memory.stages], "step_s": t.step,
            "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu, "idle_share": t.idle_share,
            "exposed_comm_share": t.comm_share, "compute_s": t.compute, "exposed_comm_s": t.exposed_comm,
            "idle_s": t.idle}


def calibrate(args: argparse.Namespace) -> int:
    from llama_megatron.training.planner.calibrate import calibrate as measure

    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    shapes: set = set()
    if args.model is not None or args.config is not None:  # the GEMMs of every layout of it on --nproc ranks
        shapes = Planner(base_config(args), args.nproc, UNIT_PROFILE, max_micro_batch=args.max_micro_batch
                         ).gemm_shapes()
    profile = measure(args.nproc, shapes)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    temp = f"{args.output}.tmp-{os.getpid()}"
    with open(temp, "w", encoding="utf-8") as fh:
        json.dump(profile.to_dict(), fh, indent=2)
        fh.write("\n")
    os.replace(temp, args.output)
    link = profile.intra_node
    print(f"{profile.description} ({profile.cores_per_node} cores; {len(profile.gemm_measured)} GEMM shapes timed): "
          f"GEMM peak {profile.peak('bf16') / 1e9:.1f} GFLOP/s (half at "
          f"{profile.gemm_half_flops / 1e6:.1f} MFLOP), attention {profile.attention_efficiency:.2f} of it, memory "
          f"{profile.hbm_bandwidth / 1e9:.1f} GB/s, all-reduce {link.bandwidth / 1e9:.2f} GB/s + "
          f"{link.latency * 1e6:.0f} us per step; wrote {args.output} (plan --device-file {args.output})")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate(args)
    _check(args)
    device = load_device(args.device, args.device_file)
    base = base_config(args)
    planner = Planner(base, args.gpus, device, args.gpus_per_node, args.precision, args.schedules,
                      args.tp_across_nodes, args.max_micro_batch, args.memory_margin)
    if args.layout is not None:
        results = [planner.check(Layout.parse(args.layout))]
        planned = [r for r in results if isinstance(r, Planned)]
        refused = [r for r in results if isinstance(r, Refused)]
    else:
        bar = TaskProgress("plan", 0, unit="layout groups", enabled=not args.json)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.advance()

        planned, refused = planner.search(progress)
        bar.close()
    where = (f"{args.gpus} x {device.name} ({planner.gpus_per_node} per node), {args.precision}, seq "
             f"{planner.base_config.seq_length}, global batch {planner.base_config.batch.global_batch_size}")
    # DeepSpeed's default reduce bucket next to a small model: said for the best layout (what --write writes)
    note = bucket_note(planned[0].memory.stages) if planned else None
    if args.json:
        json.dump({"cluster": where, "device": device.name, "layouts": [_record(p, args.gpus) for p in planned],
                   "refused": [{"label": r.layout.label(args.gpus), "reason": r.reason} for r in refused],
                   "note": note}, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(f"{len(planned)} layouts fit, {len(refused)} do not: {where}")
        if planned:
            print(HEADER)
            for rank, p in enumerate(planned[:args.top], 1):
                print(_row(rank, p, args.gpus))
            if note:
                print(f"{note} (layout 1)")
        shown = {}
        for r in refused:  # the nearest misses first, one per reason
            shown.setdefault(r.reason.split(" needs ")[0] if r.over else r.reason, r)
        if refused:
            print("not feasible (nearest first):")
            for r in list(shown.values())[:5]:
                print(f"  {r.layout.label(args.gpus)}: {r.reason}")
    if args.write:
        if not planned:
            raise ConfigError("no layout fits: nothing to write")
        path, ds_path = write_layout(args.write, base, planned[0].layout)
        print(f"wrote {path} (and {ds_path}): {planned[0].layout.label(args.gpus)}", file=sys.stderr if args.json
              else sys.stdout)
    return 0 if planned else 1
