#!/usr/bin/env bash
# The next session's device calls (written in the fourteenth), P7 first:
#   run(command="bash benchmarks/device_s18.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# .whl: fla-core 0.6.0 and openk3's serving dependencies as wheels (benchmarks/device_common.sh);
# .warm: a call's warm.tgz unpacked, if one is at hand.
# 1 (nvidia-h200): the fourteenth session's last changes, made after its device time ran out
#    (gradient clipping folded into Muon's momentum kernel; a momentum of another layout taking
#    the reference; the kernels' device guard; QB batched by size): their GPU tests beside a
#    200-step curve, then the step against the peer with its profile (device_s17.sh 3 before
#    them: 1.995x and 1.987x, 17.5% MFU).
# 2 (nvidia-h200): tests/parallel/test_compile.py (after the norms' autocast dtype it ran out of
#    time beside a loss curve in device_s17.sh 3), then the census of one eager step.
# 3 (nvidia-h200): P8 as device_s12.sh 1 left it: the decode steps against the peer, censuses.
# 4 (nvidia-h200-x2): P7's two-GPU targets: `small` on one GPU and on two (FSDP2, the same
#    per-GPU batch: tokens/s ratio, target 1.8x), then `medium` on two GPUs (MFU, target 25%,
#    and peak memory), each as `openk3 train` logs it.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  curve_beside_tests 230 220 tests/ops/test_muon.py tests/train/test_optim.py tests/train/test_graphed.py
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
2)
  gpu_tests 330 tests/parallel/test_compile.py
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --no-peer \
    --census > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  ;;
3)
  bash benchmarks/device_s12.sh 1  # nested: shares this call's setup and saver
  ;;
4)
  train_run 130 small_1gpu 1 --preset small --max-steps 30 --warmup-steps 5 --log-interval 5
  train_run 170 small_2gpu 2 --preset small --max-steps 30 --warmup-steps 5 --log-interval 5
  train_run 230 medium_2gpu 2 --preset medium --max-steps 20 --warmup-steps 3 --log-interval 4
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
