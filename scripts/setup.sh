#!/usr/bin/env bash
# Create .venv (Python >= 3.10) and install openk3 with its test extras; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import openk3, pytest, pytest_timeout, xdist, transformers, fastapi, openai, lm_eval, prometheus_client" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  # The CPU build of torch; on a CUDA machine install the matching torch first instead.
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test]"
fi
# Triton for the CPU tests of our Triton kernels, which run them in its interpreter
# (tests/ops/checks.py, run_triton_interpreted) -- in a directory of its own, because with triton
# importable transformers' Kimi Linear picks fla's GPU kernels even on the CPU. numpy below 2.4:
# triton 3.6's interpreter cannot index with numpy 2.4's one-element arrays.
if [ ! -e .venv/triton-interpreter/.done ]; then
  python -m pip install -q --target .venv/triton-interpreter "triton==3.6.0" "numpy==2.3.5"
  touch .venv/triton-interpreter/.done
fi
