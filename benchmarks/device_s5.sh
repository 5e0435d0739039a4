#!/usr/bin/env bash
# Fifth session's device runs (issues P7, P9-P12), one call per phase on nvidia-h200-x2:
#   run(command="bash benchmarks/device_s5.sh N", kind="nvidia-h200-x2", carry=[".whl", ".triton-cache"], timeout_s=590)
# then unpack the call's autotune.tgz into the repo root. Results in docs/benchmarks.md.
#   1: P10 GPU tests (QAT, packed kernels with MXFP8 inputs) on GPU 0 while GPU 1 trains `small`
#      alone; then `small` on both GPUs (FSDP2, same per-GPU batch: P7's scaling); then P11's
#      2-GPU context-parallel test and the KDA KCP benchmark at 256K tokens.
#   2: P11: `small` training at 128K-512K tokens with and without --cp 2; then serving one
#      1M-token prompt on one GPU.
#   3: P11's 2-GPU runs again, then P10 tests, the 1M-token prompt and P12 rollouts (not run:
#      no 2-GPU machine was lent); 4: the single-GPU part of 3, run instead (kind nvidia-h200).
source "$(dirname "$0")/device_common.sh"
phase=${1:?phase 1, 2 or 3}
small() {  # small SECONDS NAME NPROC: 40 steps of `small` for tokens/s (no compile: startup)
  train_run "$1" "$2" "$3" --preset small --max-steps 40 --warmup-steps 5 --log-interval 5 --no-compile
}
if [ "$phase" = 1 ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    gpu_tests 200 tests/train/test_qat.py tests/ops/test_mx_kernels.py tests/checkpoint/test_packed_load.py ) & a=$!
  ( export CUDA_VISIBLE_DEVICES=1; small 200 small_1gpu 1 ) & b=$!
  wait $a $b
  small 150 small_2gpu 2
  gpu_tests 90 tests/parallel/test_context_parallel.py
  timeout 80 torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py kda --seq-len 262144 \
    > "$OUT/kcp_kda.log" 2>&1; echo "== rc $?" >> "$OUT/kcp_kda.log"
elif [ "$phase" = 2 ]; then
  gpu_tests 110 tests/parallel/test_context_parallel.py
  timeout 60 torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py kda --seq-len 262144 \
    > "$OUT/kcp_kda.log" 2>&1; echo "== rc $?" >> "$OUT/kcp_kda.log"
  model() {  # model SECONDS CP STEPS SEQ_LEN...: rows print as measured; an OOM ends the list
    local limit=$1 cp=$2 steps=$3; shift 3
    timeout -k 10 "$limit" torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py model \
      --cp "$cp" --steps "$steps" --seq-lens "$@" >> "$OUT/kcp_model.log" 2>&1
    echo "== cp $cp: rc $?" >> "$OUT/kcp_model.log"
  }
  model 150 1 2 131072 262144 524288
  model 230 2 2 131072 262144 524288
elif [ "$phase" = 3 ]; then
  # the last call of the session's device time: P11's 2-GPU test and --cp 2 (phase 2 found the
  # compile failure), then one GPU each: P10's tests and the 1M-token prompt; P12's rollouts
  gpu_tests 100 -s tests/parallel/test_context_parallel.py
  timeout -k 10 180 torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py model --cp 2 \
    --steps 1 --seq-lens 131072 262144 524288 > "$OUT/kcp_model.log" 2>&1
  echo "== rc $?" >> "$OUT/kcp_model.log"
  ( export CUDA_VISIBLE_DEVICES=0
    gpu_tests 100 -k "mxfp8 or qat" tests/train/test_qat.py tests/ops/test_mx_kernels.py \
      tests/checkpoint/test_packed_load.py
    timeout -k 5 150 python3 benchmarks/serve_bench.py --parts million > "$OUT/million.log" 2>&1
    echo "== rc $?" >> "$OUT/million.log" ) & a=$!
  ( export CUDA_VISIBLE_DEVICES=1 GPU_LOG=gpu_tests_1
    timeout -k 5 165 python3 benchmarks/rollout_bench.py --preset small --device cuda --lengths heavy \
      --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --steps 6 --finish-fraction 0.5 0.75 \
      > "$OUT/rollout_heavy1024.log" 2>&1; echo "== rc $?" >> "$OUT/rollout_heavy1024.log"
    gpu_tests 55 tests/posttrain ) & b=$!
  wait $a $b
elif [ "$phase" = 4 ]; then
  # phase 3 on one GPU (only nvidia-h200 was lent for the last call): P10's tests, the 1M-token
  # prompt, P12's rollouts and tests, one after the other
  gpu_tests 100 -k "mxfp8 or qat" tests/train/test_qat.py tests/ops/test_mx_kernels.py \
    tests/checkpoint/test_packed_load.py
  timeout -k 5 150 python3 benchmarks/serve_bench.py --parts million > "$OUT/million.log" 2>&1
  echo "== rc $?" >> "$OUT/million.log"
  timeout -k 5 165 python3 benchmarks/rollout_bench.py --preset small --device cuda --lengths heavy \
    --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --steps 6 --finish-fraction 0.5 0.75 \
    > "$OUT/rollout_heavy1024.log" 2>&1; echo "== rc $?" >> "$OUT/rollout_heavy1024.log"
  gpu_tests 50 tests/posttrain
fi
summary
