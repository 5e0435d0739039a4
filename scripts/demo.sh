#!/usr/bin/env bash
# The main job: set up, then build the debug K3 model and generate from it on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
openk3 params --preset k3
openk3 generate --preset debug --random-init --prompt "def fibonacci(n):" --max-new-tokens 48 --seed 0
