#!/usr/bin/env bash
# The next session's device calls (written in the fourteenth), P7 first:
#   run(command="bash benchmarks/device_s18.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# .whl: fla-core 0.6.0 and openk3's serving dependencies as wheels (docs/benchmarks.md, "Machines");
# .warm: a call's warm.tgz unpacked (benchmarks/device_common.sh), if one is at hand.
# 1 (nvidia-h200): the GPU tests of the compiled regions (tests/parallel/test_compile.py: after
#    the norms' autocast dtype it ran out of time beside a loss curve in device_s17.sh 3), then
#    the step against the peer once more (device_s17.sh 3: 1.995x and 1.987x).
# 2 (nvidia-h200): P8 as device_s12.sh 1 left it: the decode steps against the peer, censuses.
# 3 (nvidia-h200-x2): P7's two-GPU targets: `small` on one GPU and on two (FSDP2, the same
#    per-GPU batch: tokens/s ratio, target 1.8x), then `medium` on two GPUs (MFU, target 25%,
#    and peak memory), each as `openk3 train` logs it.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 300 tests/parallel/test_compile.py
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
2)
  bash benchmarks/device_s12.sh 1  # nested: shares this call's setup and saver
  ;;
3)
  train_run 130 small_1gpu 1 --preset small --max-steps 30 --warmup-steps 5 --log-interval 5
  train_run 170 small_2gpu 2 --preset small --max-steps 30 --warmup-steps 5 --log-interval 5
  train_run 230 medium_2gpu 2 --preset medium --max-steps 20 --warmup-steps 3 --log-interval 4
  ;;
*) echo "phase 1, 2 or 3" >&2; exit 2 ;;
esac
summary
