#!/usr/bin/env bash
# Create .venv (if missing) with the CPU torch wheel and the package + test extras, at the tested versions.
# Idempotent: a second run returns at once while pyproject.toml, setup.py and requirements/constraints.txt are what
# the last install read (their hash is kept in .venv/.installed); after any of them changes it installs again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
stamp=.venv/.installed
wanted=$(cat pyproject.toml setup.py requirements/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch first, pinned to the CPU wheel: a bare `torch` would pull multi-GB CUDA builds.
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt -e ".[dev]"
echo "$wanted" > "$stamp"
