#!/usr/bin/env bash
# The test command: builds its own virtualenv, then lint + the whole suite (CPU, gloo, multi-process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1
.venv/bin/ruff check llama_megatron tests benchmarks
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
