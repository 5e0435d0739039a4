#!/usr/bin/env bash
# The main job: set up, then train the debug K3 model on the embedded corpus (the Python
# standard library's source) on the CPU and print samples from it. Extra flags go to
# `openk3 train` (e.g. --max-steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT_DIR:-runs/debug-$(date +%Y%m%d-%H%M%S)}
openk3 train --preset debug --out "$OUT" "$@"
openk3 plot "$OUT"
