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
from typing import Any

import torch

_GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "V100": 125.0}


def device_peak_tflops(configured: float | None) -> float | None:
    if configured:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in _GPU_PEAK_TFLOPS.items() if k in name), None)
    return measured_matmul_tflops()


def measured_matmul_tflops(n: int = 1024, repeats: int = 5) -> float:
    """fp32 matmul throughput of this process (its threads), the CPU's practical peak: measured once per thread
    count (a process running several trainings in a row measures it once)."""
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
                    self._tb.add_scalar(f"train/{key}" if not key.startswith("val") else f"eval/{key}", value, step)
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
