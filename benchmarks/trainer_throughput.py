"""Whole-trainer throughput: llama_megatron's trainer vs HF Trainer + DeepSpeed, and + Liger-Kernel when installed.

Each trainer runs under the ``deepspeed`` launcher on the same training config: the same model shape, sequence
length, micro batch, gradient accumulation, DeepSpeed ZeRO stage and precision, optimizer (torch's fused AdamW,
clipping, cosine schedule) and synthetic tokens. The first ``--warmup`` optimizer steps (compilation, allocator
warm-up) are left out; tokens/s is measured over the rest, from one host sync to another. Prints one JSON line with
tokens/s of each and the ratios.

    python benchmarks/trainer_throughput.py                # TinyLlama-1.1B, 1 GPU, seq 2048, micro 4 x GA 4, ZeRO-1 bf16
    python benchmarks/trainer_throughput.py --num-gpus 8 --config configs/pretrain/X.json --set kernels=reference
    python benchmarks/trainer_throughput.py --smoke        # tiny shapes, fp32, any device: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu_throughput import have_liger  # noqa: E402  (this directory is the script's first import path)

from llama_megatron.parallel.placement import launcher_command  # noqa: E402
from llama_megatron.parallel.process_groups import end_process_groups, skip_cpu_shared_memory_op  # noqa: E402
from llama_megatron.training.config import TrainingConfig  # noqa: E402
from llama_megatron.training.engine.deepspeed_config import load_deepspeed_json, precision, zero_stage  # noqa: E402

DEFAULT_CONFIG = "configs/pretrain/tinyllama-1.1b-1gpu.json"
SMOKE_OVERRIDES = ["model=configs/models/tiny.json", "seq_length=64", "batch.micro_batch_size=2",
                   "batch.global_batch_size=4", "deepspeed_config=ds_configs/zero1_fp32.json", "kernels=reference"]
HF_VARIANTS = {"hf_trainer": False, "hf_trainer_liger": True}  # name -> use_liger_kernel


def launch_logged(num_gpus: int, entry: list[str], log_path: str) -> None:
    """``entry`` under the deepspeed launcher, its output in ``log_path`` (its tail in the error)."""
    cmd = [*launcher_command(num_gpus), *entry]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    with open(log_path, "w", encoding="utf-8") as log:
        result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        with open(log_path, encoding="utf-8") as log:
            tail = log.read()[-3000:]
        raise SystemExit(f"{' '.join(cmd)} failed ({result.returncode}):\n{tail}")


def _set_args(overrides: list[str]) -> list[str]:
    return [a for item in overrides for a in ("--set", item)]


def ours_tokens_per_s(args, overrides: list[str], work: str) -> float:
    """Our trainer's tokens/s over the logging windows after the first (which holds the warm-up steps)."""
    out = os.path.join(work, "ours")
    run = [*overrides, f"train.steps={args.steps}", f"logging.interval={args.warmup}", f"output_dir={out}",
           "checkpoint.save=null", "eval.interval=0"]
    launch_logged(args.num_gpus, ["--module", "llama_megatron.train", "--config", args.config, *_set_args(run)],
            os.path.join(work, "ours.log"))
    config = TrainingConfig.from_file(args.config, run)
    return tokens_per_s_after(out, args.warmup, config.batch.global_batch_size * config.seq_length * args.warmup)


def tokens_per_s_after(output_dir: str, warmup: int, tokens_per_window: int) -> float:
    """A run's tokens/s over its logging windows (each of ``tokens_per_window`` tokens) after step ``warmup``, from
    its metrics.jsonl: total tokens over total time."""
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        windows = [json.loads(line) for line in fh]
    timed = [w["tokens_per_s"] for w in windows if w["step"] > warmup and "tokens_per_s" in w]
    return tokens_per_window * len(timed) / sum(tokens_per_window / t for t in timed)


def hf_worker(args, overrides: list[str]) -> None:
    """One rank of HF Trainer + DeepSpeed on the training config's shapes; rank 0 writes tokens/s to --result."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    skip_cpu_shared_memory_op()  # as our trainer does: HF's DeepSpeed start would JIT-build it on CPU
    config = TrainingConfig.from_file(args.config, overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro, seq = config.batch.micro_batch_size, config.seq_length
    accumulation = config.batch.global_batch_size // (micro * world)
    ds = load_deepspeed_json(config.deepspeed_config)
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto", train_batch_size="auto",
              gradient_clipping="auto")
    bf16 = precision(ds) == "bf16"
    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(LlamaConfig(**config.model.to_hf_dict(), attn_implementation="sdpa"))

    class RandomTokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return config.batch.global_batch_size * args.steps

        def __getitem__(self, index: int) -> dict:
            ids = torch.randint(0, config.model.vocab_size, (seq,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids, "labels": ids}

    cuda = torch.cuda.is_available()
    marks: dict[int, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step in (args.warmup, args.steps):
                if cuda:
                    torch.cuda.synchronize()
                marks[state.global_step] = time.perf_counter()

    opt = config.optimizer
    training_args = TrainingArguments(
        output_dir=os.path.join(args.work, "hf"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, max_steps=args.steps, learning_rate=opt.lr,
        weight_decay=opt.weight_decay, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], adam_epsilon=opt.eps,
        max_grad_norm=opt.clip_grad, lr_scheduler_type="cosine", warmup_steps=opt.warmup_steps,
        optim="adamw_torch_fused", bf16=bf16, deepspeed=ds, use_liger_kernel=HF_VARIANTS[args.worker],
        logging_steps=args.steps, save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        seed=config.seed, use_cpu=not cuda)
    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(), callbacks=[Clock()])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        tokens = (args.steps - args.warmup) * config.batch.global_batch_size * seq
        engine = trainer.model_wrapped  # the DeepSpeed engine: the comparison holds only if HF really ran ZeRO
        with open(args.result, "w", encoding="utf-8") as fh:
            json.dump({"tokens_per_s": tokens / (marks[args.steps] - marks[args.warmup]),
                       "zero": engine.zero_optimization_stage() if trainer.is_deepspeed_enabled else None,
                       "steps": trainer.state.global_step}, fh)
    # Left to the interpreter's exit, gloo's teardown aborted this worker once after its result was written
    # ("terminate called without an active exception", exit -6, in CI): take the groups down in order, as our
    # commands do.
    end_process_groups()


def hf_tokens_per_s(args, variant: str, zero: int, work: str) -> float:
    result = os.path.join(work, f"{variant}.json")
    entry = [os.path.abspath(__file__), "--worker", variant, "--result", result, "--work", work,
             "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup), *_set_args(args.set)]
    launch_logged(args.num_gpus, entry, os.path.join(work, f"{variant}.log"))
    with open(result, encoding="utf-8") as fh:
        measured = json.load(fh)
    if (measured["zero"], measured["steps"]) != (zero, args.steps):
        raise SystemExit(f"{variant} ran ZeRO {measured['zero']} for {measured['steps']} steps, not ZeRO {zero} "
                         f"for {args.steps}: not comparable")
    return measured["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(ROOT, DEFAULT_CONFIG), help="our training config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--steps", type=int, default=25, help="optimizer steps per trainer")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed; --steps must be a multiple")
    parser.add_argument("--num-gpus", type=int, default=1, help="processes per trainer (GPUs; CPU processes)")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes and 4 steps: the script runs")
    parser.add_argument("--worker", choices=sorted(HF_VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # appended by the launcher
    args = parser.parse_args()
    if args.worker:
        hf_worker(args, args.set)
        return
    if args.smoke:
        args.set = SMOKE_OVERRIDES + args.set
        args.steps, args.warmup = 4, 2
    if args.steps <= args.warmup or args.steps % args.warmup:
        parser.error("--steps must be a larger multiple of --warmup (our trainer logs once per --warmup steps)")
    config = TrainingConfig.from_file(args.config, args.set)
    ds = load_deepspeed_json(config.deepspeed_config)
    variants = ["hf_trainer", *(["hf_trainer_liger"] if have_liger() else [])]
    with tempfile.TemporaryDirectory(prefix="trainer-throughput-") as work:
        ours = ours_tokens_per_s(args, args.set, work)
        theirs = {name: hf_tokens_per_s(args, name, zero_stage(ds), work) for name in variants}
    result = {"benchmark": "trainer_throughput", "config": os.path.basename(args.config), "kernels": config.kernels,
              "params_m": round(config.model.num_parameters() / 1e6, 1), "seq": config.seq_length,
              "micro_batch": config.batch.micro_batch_size, "global_batch": config.batch.global_batch_size,
              "processes": args.num_gpus, "zero": zero_stage(ds), "precision": precision(ds),
              "timed_steps": args.steps - args.warmup, "ours_tokens_per_s": round(ours, 1)}
    for name, tokens_per_s in theirs.items():
        result[f"{name}_tokens_per_s"] = round(tokens_per_s, 1)
        result[f"ratio_vs_{name}"] = round(ours / tokens_per_s, 3)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
