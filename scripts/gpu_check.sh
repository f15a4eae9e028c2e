#!/usr/bin/env bash
# Everything issue 10 measures on a GPU, in one call: the CUDA tests (tests/gpu), the model-step and per-document
# attention benchmark (benchmarks/gpu_throughput.py) and the whole-trainer one (benchmarks/trainer_throughput.py).
# Installs the wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh) when DeepSpeed is missing.
# Results go to $OUT (default runs/gpu-check), one file per part. Parts: tests, model, trainer (default: all three;
# name some to split the work over device calls of at most 10 minutes each).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
PY=${PYTHON:-python3}
parts=${*:-tests model trainer}
for part in $parts; do
    case $part in tests|model|trainer) ;; *) echo "error: unknown part $part (tests, model, trainer)" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
if ! "$PY" -c "import deepspeed" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        .whl/deepspeed-*.tar.gz
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.txt" 2>&1
"$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/device.txt"
status=0
for part in $parts; do
    case $part in
        tests) "$PY" -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/tests_gpu.txt" 2>&1 || status=1
               tail -n 3 "$OUT/tests_gpu.txt" ;;
        model) "$PY" benchmarks/gpu_throughput.py > "$OUT/gpu_throughput.jsonl" 2> "$OUT/gpu_throughput.err" || status=1
               cat "$OUT/gpu_throughput.jsonl" ;;
        trainer) "$PY" benchmarks/trainer_throughput.py > "$OUT/trainer_throughput.jsonl" \
                     2> "$OUT/trainer_throughput.err" || status=1
                 cat "$OUT/trainer_throughput.jsonl" ;;
    esac
done
exit $status
