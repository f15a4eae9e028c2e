#!/usr/bin/env bash
# Wheels for a GPU machine without network (python 3.12, CUDA torch, transformers and triton already there):
# DeepSpeed and what it imports, Liger-Kernel, accelerate (HF Trainer) and pytest, into .whl/ (git-ignored).
# Carry .whl to the machine and run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
    hjson pydantic pydantic-core annotated-types typing-inspection py-cpuinfo einops liger-kernel accelerate \
    pytest pluggy iniconfig pytest-timeout
"$PIP" download -q --no-deps --no-binary=:all: -d .whl deepspeed==0.19.8
ls .whl
