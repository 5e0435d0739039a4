#!/usr/bin/env bash
# The fifteenth session's device calls (P7 on `nvidia-h200`):
#   run(command="bash benchmarks/device_s19.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: training's short convolution as openk3's Triton kernels and the training router's expert
#    choice by the Triton kernel: their GPU tests and the whole models' fast path beside a
#    200-step curve, the kernels against fla / torch.topk (conv_speed.py), QB's margins by topk
#    and by sort (qb_speed.py), then the step against the peer with its profile.
# 2: the convolution's block sizes swept again (conv_speed.py), the step against the peer with
#    its profile, then tests/parallel/test_compile.py.
# 3: the backward convolution in two passes and QB's thresholds as one Triton kernel: their GPU
#    tests, the step against the peer with its profile, conv_speed.py and qb_speed.py (the
#    session's last ~320 s of device time).
source "$(dirname "$0")/device_common.sh"
speeds() {
  timeout -k 10 90 python3 benchmarks/conv_speed.py > "$OUT/conv_speed.log" 2>&1
  echo "== rc $?" >> "$OUT/conv_speed.log"
}
step_vs_peer() {
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
}
case "${1:?phase}" in
1)
  curve_beside_tests 230 220 tests/ops/test_conv.py tests/ops/test_router.py tests/model/test_gpu.py \
    -k "triton or pooled or router or fast_path_matches_reference_and"
  speeds
  timeout -k 10 60 python3 benchmarks/qb_speed.py > "$OUT/qb_speed.log" 2>&1
  echo "== rc $?" >> "$OUT/qb_speed.log"
  step_vs_peer
  ;;
2)
  speeds
  step_vs_peer
  gpu_tests 200 tests/parallel/test_compile.py tests/ops/test_router.py
  ;;
3)
  gpu_tests 70 tests/ops/test_conv.py tests/ops/test_router.py -k "triton or kth or training_router"
  step_vs_peer
  speeds
  timeout -k 10 40 python3 benchmarks/qb_speed.py > "$OUT/qb_speed.log" 2>&1
  echo "== rc $?" >> "$OUT/qb_speed.log"
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
