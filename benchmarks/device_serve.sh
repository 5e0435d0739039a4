#!/usr/bin/env bash
# The serving measurements on one H200 in one call:
#   run(command="bash benchmarks/device_serve.sh", carry=[".whl", ".triton-cache"], timeout_s=590)
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$TRITON_CACHE_DIR"
save_autotune() { (cd "$TRITON_CACHE_DIR/.." && find .triton-cache -name '*.autotune.json' \
  | tar czf "$OUT/autotune.tgz.tmp" -T - && mv "$OUT/autotune.tgz.tmp" "$OUT/autotune.tgz") 2>/dev/null; }
( while sleep 20; do save_autotune; done ) & saver=$!
trap 'kill $saver 2>/dev/null; save_autotune' EXIT
timeout 120 python3 -m pytest -m gpu tests/serve -q -p no:cacheprovider -rf -x > "$OUT/serve_gpu_tests.log" 2>&1
timeout 400 python3 benchmarks/serve_bench.py > "$OUT/serve_bench.log" 2>&1
tail -5 "$OUT"/*.log
