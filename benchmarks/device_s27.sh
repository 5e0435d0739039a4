#!/usr/bin/env bash
# The nineteenth session's device calls:
#   run(command="bash benchmarks/device_s27.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the AttnRes backward reading a row's sources once (one tile in registers) and the walking
#    convolution backward: attnres_bench.py, conv_speed.py, their GPU tests, `small`'s step
#    against the peer with its profile.
# 2: the convolution's kernels again and the step with its profile.
# 3: the loss curve beside the GPU tests of the changes; the step again.
# 4: the experts' GPU tests.
# 5: phase 3's failed tests again after the fix.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 10 80 python3 benchmarks/attnres_bench.py > "$OUT/attnres.log" 2>&1
  timeout -k 10 220 python3 benchmarks/conv_speed.py > "$OUT/conv_speed.log" 2>&1
  gpu_tests 100 tests/ops/test_attnres.py tests/ops/test_conv.py -k "not pooled"
  ;;
2)  # the convolution's GPU tests against the reference, more walking-kernel blocks, `small`'s
    # step against the peer with its profile
  gpu_tests 100 tests/ops/test_conv.py -k triton_matches -v
  timeout -k 10 150 python3 benchmarks/conv_speed.py > "$OUT/conv_speed.log" 2>&1
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
3)  # `small`'s 200-step loss curve beside the GPU tests the kernels reach, then the step again
  curve_beside_tests 280 280 tests/ops/test_attnres.py tests/train/test_graphed.py tests/parallel/test_compile.py \
    tests/checkpoint/test_packed_load.py -k "sealed or graphed_steps_match or compiled_step or packed"
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
4)  # the GPU tests of the experts (combine_pairs, eighteenth session) not run since
  gpu_tests 280 tests/ops/test_moe.py tests/model/test_gpu.py
  ;;
5)  # phase 3's failed tests again, with combine_pairs no longer memoised
  gpu_tests 100 tests/train/test_graphed.py -k graphed_steps_match
  gpu_tests 80 tests/parallel/test_compile.py -k compiled_step
  ;;
*) echo "phase 1 to 5" >&2; exit 2 ;;
esac
summary
