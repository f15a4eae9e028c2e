"""The GPU benchmark script runs end to end (tiny shapes on CPU): it cannot be exercised otherwise here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from launch_utils import ROOT


def test_gpu_throughput_smoke() -> None:
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_throughput.py"), "--smoke", "--steps", "1",
         "--warmup", "1", "--attention-repeats", "1", "--kernels", "reference"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    model, attention = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert model["ours_reference"]["tokens_per_s"] > 0 and model["hf"]["tokens_per_s"] > 0
    assert "ratio_ours_reference_vs_hf" in model
    for key in ("reference_dense_mask", "ours_fast", "causal_sdpa_no_documents"):
        assert attention[key]["ms"] > 0
