"""Rank-0 progress: one line per logged step on stdout, ``metrics.jsonl`` in the output dir, TensorBoard scalars.

Throughput figures: tokens/s over the logging window; TFLOP/s per device from the model FLOP formula in
:mod:`llama_megatron.training.diagnostics.flops` (recomputation not counted); MFU against ``logging.peak_tflops`` or, when
unset, a measured fp32 matmul peak (CPU) or the device's published dense bf16 peak (known GPUs).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from llama_megatron.training.config import TrainingConfig
from llama_megatron.training.diagnostics.flops import recomputed_flops_per_token, training_flops_per_token
from llama_megatron.training.objectives import objective_of
from llama_megatron.training.pipeline.schedules import analytic_bubble
from llama_megatron.training.planner.devices import profile_for_device


def device_peak_tflops(configured: float | None, fp8: bool = False) -> float | None:
    return mfu_peak(configured, fp8)[0]


def mfu_peak(configured: float | None, fp8: bool = False,
             device_name: str | None = None) -> tuple[float | None, str]:
    """The TFLOP/s per device MFU is against, and what it is: ``logging.peak_tflops``; on a GPU its dense bf16 (with
    ``fp8``: dense FP8, as Megatron's and torchtitan's FP8 figures are) peak from its shipped profile
    (``configs/devices``: H100 SXM and PCIe, H200, B200, A100, L40S, MI300X; each figure's source in the file), found
    by the device's name (``device_name``, default this process's GPU); on a CPU this process's measured fp32
    matmul rate (its FP8 GEMMs have no separate peak). Never a constant."""
    if configured:
        return configured, "logging.peak_tflops"
    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    if device_name is not None:
        precision = "fp8" if fp8 else "bf16"
        profile = profile_for_device(device_name)
        peak = profile.peak_flops.get(precision) if profile is not None else None
        if not peak:
            return None, f"no known dense {precision} peak for {device_name}: set logging.peak_tflops"
        return peak / 1e12, f"{device_name}'s dense {precision} peak (configs/devices/{profile.name}.json)"
    return measured_matmul_tflops(), "this CPU's measured fp32 matmul rate"


def measured_matmul_tflops(n: int = 512, repeats: int = 3) -> float:
    """fp32 matmul throughput of this process (its threads), the CPU's practical peak: measured once per thread
    count (a process running several trainings in a row measures it once). 512 x 512 products already run at the
    rate of larger ones on a core (85 against 90 GFLOP/s for 1024 x 1024, an Intel Xeon) in a tenth of the time
    (16 ms: every rank of every run measures it as it starts)."""
    return _measured_matmul_tflops(n, repeats, torch.get_num_threads())


@functools.cache
def _measured_matmul_tflops(n: int, repeats: int, threads: int) -> float:
    generator = torch.Generator().manual_seed(0)  # its own: the global RNG's stream is the run's (dropout masks)
    a, b = torch.randn(n, n, generator=generator), torch.randn(n, n, generator=generator)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


class RunLogger:
    def __init__(self, enabled: bool, output_dir: str, tensorboard_dir: str | None,
                 wandb_project: str | None = None, run_config: dict | None = None) -> None:
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        self._metrics = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._metrics = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            import wandb  # optional dependency, only when asked for

            self._wandb = wandb.init(project=wandb_project, config=run_config)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def log(self, step: int, metrics: dict[str, Any], line: str | None = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        # JSON has no NaN or infinity: such values are written as null and named under "nonfinite"
        nonfinite = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        if nonfinite:
            record.update({k: None for k in nonfinite}, nonfinite=nonfinite)
        self._metrics.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                if self._tb is not None:
                    evaluation = key.startswith(("val", "tasks"))
                    self._tb.add_scalar(f"eval/{key}" if evaluation else f"train/{key}", value, step)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if line:
            print(line, flush=True)

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


@dataclass(frozen=True)
class Cadence:
    """What a finished step does besides training: evaluate, save, log (a log line at every evaluation)."""

    evaluate: bool
    save: bool
    log: bool

    @classmethod
    def at(cls, config: TrainingConfig, step: int) -> Cadence:
        train, save = config.train, config.checkpoint
        evaluate = bool(config.eval.interval) and step % config.eval.interval == 0
        # step 1 too: the starting loss (ln of the vocabulary for a new model) is the curve's first point
        log = step % config.logging.interval == 0 or step in (1, train.steps) or evaluate
        return cls(evaluate, bool(save.save and save.interval) and (step % save.interval == 0 or step == train.steps),
                   log)


def start_line(config: TrainingConfig, pctx, device: str, zero: int, first_step: int) -> str:
    """The run's first line: parameters, device, layout (the pipeline schedule and its bubble), ZeRO, batch, steps."""
    micro_batches = config.gradient_accumulation_steps(pctx.world_size)
    pipe = config.pipeline
    bubble = analytic_bubble(pipe.schedule, pctx.pp_size, micro_batches, pipe.virtual_stages)
    chunks = f", {pipe.virtual_stages} virtual stages per rank" if pipe.virtual_stages > 1 else ""
    schedule = (f" ({pipe.schedule}{chunks}, {micro_batches} micro batches: bubble {100 * bubble:.1f}% at equal "
                "pass costs)" if pctx.pp_size > 1 else "")
    return (f"training {config.model.num_parameters() / 1e6:.1f}M parameters on {device} | tensor {pctx.tp_size} "
            f"pipeline {pctx.pp_size}{schedule} context {pctx.cp_size} data {pctx.dp_size} | ZeRO {zero} | global "
            f"batch {config.batch.global_batch_size}{objective_of(config).sample_unit(config)} x "
            f"{config.rows_per_sample * config.seq_length} tokens | steps {first_step}..{config.train.steps}")


class StepMeter:
    """Throughput over the logging window (tokens/s, TFLOP/s per device, MFU), the ETA over the run so far, and the
    step's log line and metrics record."""

    def __init__(self, config: TrainingConfig, world_size: int, start_step: int) -> None:
        self.config, self.world_size, self.start_step = config, world_size, start_step
        self.tokens_per_step = config.batch.global_batch_size * config.rows_per_sample * config.seq_length
        # the full sequence length: under CP each rank attends over whole sequences for 1/CP of the heads, so the
        # step's FLOPs are those of the unsharded model, shared by all world_size ranks (per device: / world size)
        self.flops_per_step = training_flops_per_token(config.model, config.seq_length) * self.tokens_per_step
        # hardware FLOPs: the model's and the forward passes recomputation repeats (HFU beside MFU)
        self.hardware_flops_per_step = self.flops_per_step + recomputed_flops_per_token(config) * self.tokens_per_step
        self.peak, self.peak_source = mfu_peak(config.logging.peak_tflops, fp8=config.fp8 is not None)
        self.window_start = self.run_start = time.perf_counter()
        self.window_steps = 0

    def stepped(self) -> None:
        self.window_steps += 1

    def record(self, report, lr: float, consumed: int, extras: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The metrics record and the line of step ``report.step`` (``extras``: the engine's expert load and
        objective's metrics, where it has them, and an evaluation's); the window starts again."""
        now = time.perf_counter()
        elapsed, steps = now - self.window_start, report.step - self.start_step
        tokens_per_s = self.tokens_per_step * self.window_steps / elapsed
        tflops = self.flops_per_step * self.window_steps / elapsed / 1e12 / self.world_size
        metrics: dict[str, Any] = {k: v for k, v in extras.items() if k.startswith(("val_", "tasks"))}
        hfu = self.hardware_flops_per_step / self.flops_per_step * tflops / self.peak if self.peak else None
        metrics.update(loss=report.loss, lr=lr, grad_norm=report.grad_norm, tokens_per_s=tokens_per_s,
                       tflops_per_device=tflops, mfu=tflops / self.peak if self.peak else None, hfu=hfu,
                       consumed_samples=consumed)
        if report.bad:
            metrics["bad_step"] = "; ".join(report.reasons)
        routed, objective = extras.get("expert_load"), extras.get("objective")
        load = dropped = None
        if routed is not None:
            load, dropped = routed
            metrics["expert_load"] = load
            if self.config.moe.capacity_factor is not None:  # the share of assignments dropped over capacity
                metrics["moe_dropped"] = dropped
        if objective is not None:
            metrics.update(objective)
        if extras.get("fp8") is not None:
            metrics["fp8"] = extras["fp8"]
        mfu = f" | MFU {100 * metrics['mfu']:.1f}%" if metrics["mfu"] else ""
        if hfu and self.hardware_flops_per_step != self.flops_per_step:  # recomputation: what the device did
            mfu += f" (HFU {100 * hfu:.1f}%)"
        steps_left = self.config.train.steps - report.step
        line = (f"step {report.step}/{self.config.train.steps} | loss {_fmt(report.loss, 6)} | lr {lr:.3e} | grad "
                f"norm {_fmt(report.grad_norm, 4)} | {tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s{mfu} | "
                f"ETA {format_eta((now - self.run_start) / steps * steps_left)}")
        if load is not None:  # 1.0: every expert got its share (1 / experts) of the assignments
            line += f" | expert load max/mean {max(load) * len(load):.2f}"
            if "moe_dropped" in metrics:
                line += f" | dropped {100 * dropped:.1f}%"
        if objective is not None:
            line += objective_of(self.config).log_line(objective)
        if report.bad:
            line += f" | bad step: {metrics['bad_step']}"
        if "val_loss" in metrics:
            line += f" | val loss {metrics['val_loss']:.6f}"
        if "val_ppl" in metrics:
            line += f" | val ppl {metrics['val_ppl']:.3f}"
        for key in sorted(k for k in metrics if k.startswith("tasks/")):  # lm-eval tasks (eval.tasks)
            line += f" | {key[len('tasks/'):]} {metrics[key]:.4f}"
        if "tasks_s" in metrics:
            line += f" (tasks {metrics['tasks_s']:.1f} s)"
        self.window_start, self.window_steps = time.perf_counter(), 0
        return metrics, line

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (the lm-eval tasks' time, logged apart) out of the tokens/s of this window."""
        self.window_start += seconds


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"  # nan and inf print as such
