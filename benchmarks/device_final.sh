#!/usr/bin/env bash
# This session's last device call (nvidia-h200-x2), ordered so each GPU measures what matters
# most first, with the autotuning results of earlier calls carried in .triton-cache:
#   run(command="bash benchmarks/device_final.sh", kind="nvidia-h200-x2", carry=[".whl", ".triton-cache"], timeout_s=595)
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$TRITON_CACHE_DIR"
save_autotune() { (cd "$TRITON_CACHE_DIR/.." && find .triton-cache -name '*.autotune.json' \
  | tar czf "$OUT/autotune.tgz.tmp" -T - && mv "$OUT/autotune.tgz.tmp" "$OUT/autotune.tgz") 2>/dev/null; }
( while sleep 20; do save_autotune; done ) & saver=$!
trap 'kill $saver 2>/dev/null; save_autotune' EXIT
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 230 python3 benchmarks/kda_bench.py --T 8192 1024 --softplus-T 8192 > "$OUT/kda.log" 2>&1
  timeout 110 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
  timeout 90 python3 benchmarks/model_bench.py --preset small --batch 1 --seq 4096 > "$OUT/model.log" 2>&1
) & gpu0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 benchmarks/serve_bench.py --parts decode ttft peer eager > "$OUT/serve_bench.log" 2>&1
  timeout 100 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 3 --no-peer > "$OUT/train.log" 2>&1
) & gpu1=$!
wait $gpu0 $gpu1
timeout 120 torchrun --nproc-per-node 2 -m benchmarks.moonep_ep --tokens 8192 > "$OUT/moonep_ep.log" 2>&1
for f in "$OUT"/*.log; do echo "== $f"; tail -n 4 "$f"; done
