#!/usr/bin/env bash
# The thirteenth session's calls, issue P7:
#   run(command="bash benchmarks/device_s15.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the graphed step's GPU test (against two eager runs: their distance is the noise), then
#    the graphed and the eager step profiled with every kernel's and op's GPU time saved
#    (benchmarks/common.py: profile_*.json), to sort the 234 ms of GPU work into categories.
# 2: after the changes the profile pointed to: throughput graphed and eager against the
#    transformers peer, the ops' GPU tests, and a 200-step loss curve beside the twelfth
#    session's (device_s14.sh 2).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 200 python3 -m pytest -m gpu tests/train/test_graphed.py -x -q -s -p no:cacheprovider \
    -o faulthandler_timeout=190 > "$OUT/gpu_tests.log" 2>&1
  echo "== rc $?" >> "$OUT/gpu_tests.log"
  for mode in cuda-graph no-cuda-graph; do
    timeout -k 10 150 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 5 --no-peer \
      --profile --$mode > "$OUT/profile_$mode.log" 2>&1
    echo "== rc $?" >> "$OUT/profile_$mode.log"
  done
  ;;
2)
  # the 200-step curve (device_s14.sh 2's settings) beside the GPU tests: neither is timed
  (OPENK3_CACHE=/tmp/cache-fused timeout -k 10 230 python3 -m openk3 train --preset small --max-steps 200 \
    --warmup-steps 20 --log-interval 5 --eval-interval 100 --ckpt-interval 100000 --num-samples 0 \
    --out /tmp/runs/fused > "$OUT/fused.log" 2>&1; echo "== rc $?" >> "$OUT/fused.log"
   cp /tmp/runs/fused/metrics.jsonl "$OUT/fused.metrics.jsonl") &
  timeout -k 5 200 python3 -m pytest -m gpu tests/train/test_optim.py tests/train/test_graphed.py -q -s \
    -p no:cacheprovider -rfE --tb=short > "$OUT/gpu_tests.log" 2>&1
  echo "== rc $?" >> "$OUT/gpu_tests.log"
  wait
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
