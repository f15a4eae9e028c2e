#!/usr/bin/env bash
# Create .venv (if missing) with the CPU torch wheel and the package + test extras, at the tested versions.
# Idempotent: a second run only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch first, pinned to the CPU wheel: a bare `torch` would pull multi-GB CUDA builds.
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[dev]"
