#!/usr/bin/env bash
# The device runs of issues 2-5 (docs/benchmarks.md), in phases of one call each on
# nvidia-h200-x2 (each under the 600 s limit); at most 8 files come back per call, so each
# phase writes few:
#   run(command="bash benchmarks/device_remaining.sh N", kind="nvidia-h200-x2", carry=[".whl", ".triton-cache"], timeout_s=595)
# (before each phase, unpack the last phase's $OUT/autotune.tgz into the repo root).
source "$(dirname "$0")/device_common.sh"
small_run() {  # small_run SECONDS NAME NPROC EXTRA...: a short bf16 run of the small preset
  local limit=$1 name=$2 n=$3; shift 3
  timeout -k 10 "$limit" torchrun --nproc-per-node "$n" -m openk3 train --preset small --out "/tmp/runs/$name" --max-steps 30 \
    --warmup-steps 5 --log-interval 2 --eval-interval 15 --ckpt-interval 1000 --num-samples 1 \
    --sample-tokens 32 "$@" > "$OUT/$name.log" 2>&1
  tail -n 40 "/tmp/runs/$name/metrics.jsonl" >> "$OUT/$name.log" 2>/dev/null
}
gpu_tests() { timeout "$1" python3 -m pytest -m gpu "${@:2}" -v -p no:cacheprovider -rfE --tb=short \
  >> "$OUT/gpu_tests.log" 2>&1; echo "== ${*:2}: rc $?" >> "$OUT/gpu_tests.log"; }
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
elif [ "$1" = 2 ]; then
  # phase 2: the GPU tests (one log), the small model's forward+backward against the reference,
  # training throughput, and the 1-GPU, 2-GPU and 2-GPU --ep 2 runs of `openk3 train`. At most 8
  # files come back: the benchmarks print their rows (OUT unset: no JSON files).
  (
    export CUDA_VISIBLE_DEVICES=0
    gpu_tests 100 tests/model; gpu_tests 90 tests/serve
    env -u OUT timeout 110 python3 benchmarks/model_bench.py --preset small --batch 1 --seq 4096 \
      > "$OUT/model.log" 2>&1
    gpu_tests 80 tests/ops
  ) & gpu0=$!
  (
    export CUDA_VISIBLE_DEVICES=1
    env -u OUT timeout 160 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 5 \
      --profile > "$OUT/train.log" 2>&1
    small_run 170 small1 1
  ) & gpu1=$!
  wait $gpu0 $gpu1
  small_run 100 small2 2
  small_run 100 small2ep 2 --ep 2
elif [ "$1" = 3 ]; then
  # phase 3 (phase 2's GPU tests timed out in Triton autotuning and inductor compilation on a
  # fresh machine): the GPU tests alone on one GPU; the op tests, the whole-model error against
  # the reference and the warm-prefix TTFT on the other.
  ( export CUDA_VISIBLE_DEVICES=0; gpu_tests 410 tests/model tests/serve ) & gpu0=$!
  (
    export CUDA_VISIBLE_DEVICES=1
    gpu_tests 170 tests/ops
    env -u OUT timeout 110 python3 benchmarks/model_bench.py --preset small --batch 1 --seq 4096 \
      > "$OUT/model.log" 2>&1
    env -u OUT timeout 120 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/serve.log" 2>&1
  ) & gpu1=$!
  wait $gpu0 $gpu1
fi
summary
