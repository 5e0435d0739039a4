#!/usr/bin/env bash
# The next session's device calls (written in the fifteenth):
#   run(command="bash benchmarks/device_s20.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# .whl and .warm as device_common.sh says. The machine is released 30 s after a call: call again
# at once to keep it warm.
# 1 (nvidia-h200): P7 as committed (the convolution's backward with 16x32 tiles and one warp and
#    QB's Triton thresholds were not measured in one step together: expected ~184 ms, 18.3% MFU;
#    and the router's logits now fp32 under autocast, bf16 in every earlier run: ~+1 ms expected,
#    and the loss curve is the check of the routing numerics):
#    the GPU tests of both beside a 200-step curve, conv_speed.py (now also the backward walking
#    several blocks per program, ITERS > 1, never run on a GPU: set BWD_BLOCKS from it),
#    norm_speed.py (the 49 norms
#    outside the compiled regions: inductor's kernels at ~2-3x their floor against fla's fused
#    rms_norm, before deciding to switch), then the step against the peer
#    with its profile, then the census of one eager step (where the remaining ~14 ms to 20% MFU
#    could come from: the bf16 gradient sums of the AttnRes bank, the norms' inductor
#    reductions, fla's KDA backward).
# 2 (nvidia-h200): P8's decode measurements as the eleventh session left them (device_s12.sh 1:
#    the committed decode step against the peer, the censuses), not run since.
# 3 (nvidia-h200): tests/parallel/test_compile.py alone (it stopped at 200-330 s beside other work
#    in three sessions).
# 4 (nvidia-h200-x2): P7's two-GPU targets (device_s18.sh 4).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  curve_beside_tests 230 200 tests/ops/test_conv.py tests/ops/test_router.py -k "triton or kth or training_router"
  timeout -k 10 90 python3 benchmarks/conv_speed.py > "$OUT/conv_speed.log" 2>&1
  echo "== rc $?" >> "$OUT/conv_speed.log"
  timeout -k 10 60 python3 benchmarks/norm_speed.py > "$OUT/norm_speed.log" 2>&1
  echo "== rc $?" >> "$OUT/norm_speed.log"
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  timeout -k 10 120 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --no-peer \
    --census > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  ;;
2) bash benchmarks/device_s12.sh 1 ;;  # nested: shares this call's setup and saver
3) gpu_tests 500 tests/parallel/test_compile.py ;;
4) bash benchmarks/device_s18.sh 4 ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
