"""The planner's predicted step time against the step time the trainer measures, on this CPU.

The machine is calibrated first (``plan --calibrate`` for 2 and 4 processes); then every layout below is written
as ``plan --write`` writes it, trained ``--steps`` steps (all layouts of a process count in one launch, through
tests/scripts/train_many.py), and its measured step time (the median over the steps after the first two, from the
run's tokens/s) set against the planner's prediction on the calibrated profile. One JSON line: per layout the
predicted and measured seconds and their ratio, and per process count and overall the Spearman rank correlation
and the largest relative error.

    python benchmarks/planner_accuracy.py                       # llama-50m, seq 256, batch 8: about 10 minutes
    python benchmarks/planner_accuracy.py --steps 8 --only 2    # the 2-process layouts only
    python benchmarks/planner_accuracy.py --keep runs/accuracy  # keep profiles and runs; then, after a change
    python benchmarks/planner_accuracy.py --keep runs/accuracy --predict-only   # to the cost model: seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llama_megatron.parallel.placement import launcher_command  # noqa: E402
from llama_megatron.training.planner.calibrate import calibrate  # noqa: E402
from llama_megatron.training.planner.devices import UNIT_PROFILE, load_device  # noqa: E402
from llama_megatron.training.planner.search import Layout, Planner, layout_dict  # noqa: E402

# a Mixtral of llama-50m's size: 4 experts of half its MLP width, two active per token
SMALL_MIXTRAL = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 704,
                 "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
                 "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                 "sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "router_aux_loss_coef": 0.02, "output_router_logits": True, "tie_word_embeddings": False}
# per process count: (layout, model: None for --model)
LAYOUTS = {
    2: [("zero=1", None), ("tp=2,sp=0", None), ("tp=2", None), ("cp=2", None), ("pp=2,schedule=1f1b", None),
        ("pp=2,schedule=zb-h1", None)],
    4: [("tp=2,pp=2,schedule=1f1b", None), ("pp=4,vp=2,schedule=interleaved-1f1b", None), ("tp=2,zero=1", None),
        ("ep=2,zero=1", SMALL_MIXTRAL)],
}


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:
        return 1.0
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "llama-50m.json"))
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", type=int, choices=sorted(LAYOUTS), help="one process count")
    parser.add_argument("--keep", metavar="DIR", help="keep the calibrated profiles, configs and runs in DIR")
    parser.add_argument("--predict-only", action="store_true",
                        help="with --keep: predict again from DIR's profiles against DIR's runs (no calibration, "
                             "no training): the cost model's accuracy after a change to it")
    args = parser.parse_args()
    if args.predict_only and not args.keep:
        parser.error("--predict-only needs --keep DIR (a kept run)")
    base = {"model": args.model, "data": {"type": "synthetic"}, "seq_length": args.seq,
            "batch": {"micro_batch_size": 1, "global_batch_size": args.global_batch},
            "train": {"steps": args.steps}, "kernels": "reference",
            "logging": {"interval": 1, "tensorboard_dir": None}}
    rows, summary = [], {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        for nproc, specs in LAYOUTS.items():
            if args.only is not None and nproc != args.only:
                continue
            bases = [base if model is None else {**base, "model": model} for _spec, model in specs]
            layouts = [Layout.parse(f"{spec},mbs={args.micro_batch}") for spec, _model in specs]
            shapes = set().union(*(Planner(b, nproc, UNIT_PROFILE).gemm_shapes([layout])
                                   for b, layout in zip(bases, layouts)))
            profile = os.path.join(tmp, f"cpu{nproc}.json")
            if args.predict_only:
                device = load_device(path=profile)
            else:
                device = calibrate(nproc, shapes)
                with open(profile, "w", encoding="utf-8") as fh:
                    json.dump(device.to_dict(), fh)
            runs, cases = [], []
            for i, ((spec, _model), layout, run_base) in enumerate(zip(specs, layouts, bases)):
                planned = Planner(run_base, nproc, device).check(layout)
                if not hasattr(planned, "time"):
                    raise SystemExit(f"{spec}: {planned.reason}")
                out = os.path.join(tmp, f"{nproc}-{i}")
                path = out + ".json"
                with open(path, "w", encoding="utf-8") as fh:
                    json.dump({**layout_dict(run_base, layout), "output_dir": out}, fh)
                runs.append(["--config", path])
                cases.append((spec, planned, out))
            runs_file = os.path.join(tmp, f"runs{nproc}.json")
            with open(runs_file, "w", encoding="utf-8") as fh:
                json.dump(runs, fh)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            if not args.predict_only:
                subprocess.run([*launcher_command(nproc), os.path.join(ROOT, "tests", "scripts", "train_many.py"),
                                runs_file], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
            predicted, measured = [], []
            for _spec, planned, out in cases:
                with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
                    records = [json.loads(line) for line in fh]
                rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 2]
                step = args.global_batch * args.seq / statistics.median(rates)
                predicted.append(planned.time.step)
                measured.append(step)
                label = planned.layout.label(nproc) + (" (small Mixtral)" if planned.config.model.family.moe else "")
                rows.append({"processes": nproc, "layout": label, "predicted_s": planned.time.step,
                             "measured_s": step, "ratio": planned.time.step / step})
            summary[nproc] = {"spearman": _spearman(predicted, measured),
                              "max_relative_error": max(abs(p / m - 1) for p, m in zip(predicted, measured))}
    everything = rows
    print(json.dumps({"benchmark": "planner_accuracy", "model": os.path.basename(args.model), "seq": args.seq,
                      "global_batch": args.global_batch, "layouts": rows, "by_processes": summary,
                      "spearman": _spearman([r["predicted_s"] for r in everything],
                                            [r["measured_s"] for r in everything]),
                      "max_relative_error": max(abs(r["ratio"] - 1) for r in everything)}))


if __name__ == "__main__":
    main()
