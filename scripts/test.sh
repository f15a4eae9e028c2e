#!/usr/bin/env bash
# The test command: builds its own virtualenv, then lint + the whole suite (CPU, gloo, multi-process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# bytecode is written (into the ignored __pycache__/), even where the environment says not to: the suite starts some
# hundreds of Python processes, and each would otherwise compile the package's modules anew (0.2 s of a core apiece)
unset PYTHONDONTWRITEBYTECODE
export OMP_NUM_THREADS=1
# inductor's cache (the compiled kernels' tests) is keyed without ATEN_CPU_CAPABILITY: kernels compiled under one
# setting were loaded under another (NaN losses, an abort), so each setting the suite runs under gets its own
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)_${ATEN_CPU_CAPABILITY:-native}}"
.venv/bin/ruff check llama_megatron tests benchmarks
# Two workers, a test file each at a time (a file's launched runs are module fixtures its tests share): the
# multi-rank runs leave a core idle while a launcher starts or rank 0 checks results, the other file fills it.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder "$@"
