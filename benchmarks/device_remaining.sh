#!/usr/bin/env bash
# What the device still has to measure (docs/benchmarks.md, "Not measured yet"), in two calls on
# nvidia-h200-x2 (each under the 600 s limit); at most 8 files come back per call, so each
# phase writes few:
#   run(command="bash benchmarks/device_remaining.sh 1", kind="nvidia-h200-x2", carry=[".whl"], timeout_s=595)
#   run(command="bash benchmarks/device_remaining.sh 2", kind="nvidia-h200-x2", carry=[".whl", ".triton-cache"], timeout_s=595)
# (unpack phase 1's $OUT/autotune.tgz into the repo root before phase 2).
source "$(dirname "$0")/device_common.sh"
small_run() {  # small_run NAME NPROC EXTRA...: a short bf16 run of the small preset
  local name=$1 n=$2; shift 2
  torchrun --nproc-per-node "$n" -m openk3 train --preset small --out "/tmp/runs/$name" --max-steps 40 \
    --warmup-steps 5 --log-interval 2 --eval-interval 20 --ckpt-interval 1000 --num-samples 1 \
    --sample-tokens 32 "$@" > "$OUT/$name.log" 2>&1
  tail -n 40 "/tmp/runs/$name/metrics.jsonl" >> "$OUT/$name.log" 2>/dev/null
}
if [ "${1:-1}" = 1 ]; then
  (
    export CUDA_VISIBLE_DEVICES=0
    # most important first: the model and engine checks, then the op tests (new shapes autotune)
    timeout 150 python3 -m pytest -m gpu tests/model tests/serve tests/ops -q -p no:cacheprovider -rf \
      > "$OUT/gpu_tests.log" 2>&1
    timeout 200 python3 benchmarks/model_bench.py --preset small --batch 1 --seq 4096 > "$OUT/model.log" 2>&1
    timeout 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 5 --profile > "$OUT/train.log" 2>&1
  ) & gpu0=$!
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 540 python3 benchmarks/serve_bench.py --parts decode peer ttft > "$OUT/serve.log" 2>&1
  ) & gpu1=$!
  wait $gpu0 $gpu1
else
  CUDA_VISIBLE_DEVICES=0 timeout 200 bash -c "$(declare -f small_run); small_run small1 1"
  timeout 170 bash -c "$(declare -f small_run); small_run small2 2"
  timeout 170 bash -c "$(declare -f small_run); small_run small2ep 2 --ep 2"
fi
summary
