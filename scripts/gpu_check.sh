#!/usr/bin/env bash
# Everything the GPU issue measures, in one call of the device machine (one GPU, 16 host cores, about 9 minutes):
#
#   GPU, one part after another (cores 0-5):
#     model      benchmarks/gpu_throughput.py: a train step of TinyLlama-1.1B, Llama-2-7B dims x 8 layers and Mixtral-8x7B
#                dims x 2 layers (the MoE layer), ours (compiled: kernels auto on CUDA) vs transformers and transformers + Liger,
#                each variant's top kernels in one profiled step and its host synchronisations in another
#     fp8        the same script with --fp8 tensorwise on TinyLlama and the 7B-dims layers: ours FP8 / bf16, and
#                against HF with torchao's float8 (torchtitan's way; docs/fp8.md)
#     attention  the same script's per-document attention at 2k / 8k / 32k vs FlexAttention
#     tests      tests/gpu (every one-GPU layout in one launch, each kernels value, save + exact resume, SIGTERM)
#     trainer    benchmarks/trainer_throughput.py: our trainer vs HF Trainer + DeepSpeed (+ Liger), ZeRO-1 bf16
#   host only, beside the GPU parts (CUDA hidden, one core per rank):
#     schedules  benchmarks/parallel_overhead.py --schedules at PP4 x 8, four gloo ranks on cores 6-9: idle shares
#     planner    benchmarks/planner_accuracy.py --only 4 on cores 6-9, after the schedules
#     saves      benchmarks/checkpoint_save.py at DP2 and PP2 on cores 10-15 (the writer has host cores to itself)
#
# Results go to $OUT (default runs/gpu-check): gpu.jsonl and cpu.jsonl (one JSON line per benchmark), tests_gpu.txt,
# gpu.log and cpu.log (each part's stderr and timing), device.txt. Every part runs under a deadline (GPU_CHECK_SECONDS,
# default 540, from the start) so that what finished comes back; GPU_CHECK_SMOKE=1 is its dry run on a CPU. Installs the wheels carried in .whl/
# (scripts/fetch_gpu_wheels.sh) when DeepSpeed is missing. Name parts to run only those (default: all).
#
# Measured on an H200 machine (2026-11-27), which is what one call can hold: install 31 s; model 497 s (three shapes;
# each variant's wall_s is now in its line); attention not reached; tests 210 s cut during their 35th and last test;
# schedules 88 s and planner 139 s beside them; saves cut at 524 s (then 20 steps a run). So one call of 9 minutes
# takes `model` alone or `tests attention trainer` with the host parts; 15 minutes of device time allow two such
# calls only back to back on a warm machine (a machine's start costs 1-2 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
PY=${PYTHON:-python3}
ALL="model fp8 attention trainer tests schedules planner saves"
parts=${*:-$ALL}
for part in $parts; do
    case " $ALL " in *" $part "*) ;; *) echo "error: unknown part $part ($ALL)" >&2; exit 2 ;; esac
done
wanted() { case " $parts " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
start=$(date +%s)
deadline=$((start + ${GPU_CHECK_SECONDS:-540}))
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import deepspeed" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    DS_BUILD_OPS=0 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --target /tmp/site .whl/deepspeed-*.tar.gz
    export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
  nproc; echo "installed in $(( $(date +%s) - start )) s"; } > "$OUT/device.txt" 2>&1
# `pin CORES CMD...`: CMD on those cores where the machine has 16 (the device machine's), as it is elsewhere
pin() { if command -v taskset > /dev/null && [ "$(nproc)" -ge 16 ]; then taskset -c "$@"; else shift; "$@"; fi; }

# `part NAME LOG JSONL CORES CMD...`: CMD under what is left of the deadline, pinned; its stdout appended to JSONL
part() {
    local name=$1 log=$2 jsonl=$3 cores=$4 began left rc
    shift 4
    wanted "$name" || return 0
    began=$(date +%s)
    left=$((deadline - began))
    if [ "$left" -le 10 ]; then echo "== $name: not run (deadline)" >> "$log"; return 0; fi
    echo "== $name: $* (cores $cores, up to ${left} s)" >> "$log"
    pin "$cores" timeout -k 10 "$left" "$@" >> "$jsonl" 2>> "$log"
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - began )) s" >> "$log"
    echo "$name: exit $rc after $(( $(date +%s) - began )) s"
}

# GPU_CHECK_SMOKE=1: each benchmark's --smoke (tiny shapes, any device): the dry run of this script on a CPU
if [ -n "${GPU_CHECK_SMOKE:-}" ]; then
    smoke=(--smoke) schedules=(--schedule-hidden 128 --schedule-micro-batches 4) saves=(--smoke) trainer=(--smoke)
    kernels=(--shapes smoke,smoke-moe) fp8_shapes=(--shapes smoke --kernels reference)
else
    smoke=() schedules=(--schedule-hidden 1024 --schedule-micro-batches 8)
    saves=(--shape 0.25b --steps 12 --interval 4) kernels=(--kernels compiled)
    fp8_shapes=(--shapes tinyllama-1.1b,llama2-7b-8layers --kernels compiled)
    trainer=(--steps 10 --warmup 5 --set batch.global_batch_size=8)  # micro 4 x GA 2
fi

# host parts: no GPU. The deepspeed launcher sets CUDA_VISIBLE_DEVICES to the local ranks (0-3) whatever the
# accelerator, so the ranks would find the GPU and choose NCCL: a sitecustomize on their path hides it again.
(
    mkdir -p /tmp/gpu-check-no-cuda
    echo 'import os; os.environ["CUDA_VISIBLE_DEVICES"] = ""' > /tmp/gpu-check-no-cuda/sitecustomize.py
    export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu PYTHONPATH=/tmp/gpu-check-no-cuda:$PYTHONPATH
    (
        part schedules "$OUT/cpu.log" "$OUT/cpu.jsonl" 6-9 "$PY" benchmarks/parallel_overhead.py --schedules \
            --schedule-stages 4 "${schedules[@]}"
        [ -n "${GPU_CHECK_SMOKE:-}" ] || part planner "$OUT/cpu.log" "$OUT/cpu.jsonl" 6-9 "$PY" \
            benchmarks/planner_accuracy.py --only 4
    ) &
    part saves "$OUT/cpu.log" "$OUT/cpu.jsonl" 10-15 env OMP_NUM_THREADS=2 "$PY" benchmarks/checkpoint_save.py \
        "${saves[@]}"
    wait
) &
host=$!

part model "$OUT/gpu.log" "$OUT/gpu.jsonl" 0-5 "$PY" benchmarks/gpu_throughput.py --only models --profile \
    "${kernels[@]}" "${smoke[@]}"
part fp8 "$OUT/gpu.log" "$OUT/gpu.jsonl" 0-5 "$PY" benchmarks/gpu_throughput.py --only models --fp8 tensorwise \
    "${fp8_shapes[@]}" "${smoke[@]}"
part attention "$OUT/gpu.log" "$OUT/gpu.jsonl" 0-5 "$PY" benchmarks/gpu_throughput.py --only attention "${smoke[@]}"
[ -n "${GPU_CHECK_SMOKE:-}" ] && export LLAMA_MEGATRON_GPU_TESTS_ON_CPU=1
part tests "$OUT/gpu.log" "$OUT/tests_gpu.txt" 0-5 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
part trainer "$OUT/gpu.log" "$OUT/gpu.jsonl" 0-5 "$PY" benchmarks/trainer_throughput.py "${trainer[@]}"
wait "$host"
tail -n 3 "$OUT/tests_gpu.txt" 2>/dev/null
cat "$OUT/gpu.jsonl" "$OUT/cpu.jsonl" 2>/dev/null | cut -c1-600
! grep -q "exit [1-9]" "$OUT/gpu.log" "$OUT/cpu.log" 2>/dev/null
