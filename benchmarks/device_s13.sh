#!/usr/bin/env bash
# The twelfth session's calls on one H200 (issue P7: the training step as CUDA graphs):
#   run(command="bash benchmarks/device_s13.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1: the graphed step's GPU tests (against eager steps), then training throughput of `small` at
#    batch 4 x 4096 with graphs (the default) against the transformers peer in the same run.
# 2: the loss curves of 200 `small` steps before (the eleventh session's package, carried as
#    .before: `git archive c412b69 openk3 | tar -x -C .before`) and after, side by side on the
#    GPU, while the graphed step's GPU test runs (with stack dumps if it hangs):
#    run(..., carry=[".whl", ".triton-cache", ".before"])
# 4: the graphed step's GPU test alone. (Phase 3, the profile, moved to device_s14.sh 1 unrun.)
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 200 tests/train/test_graphed.py -v
  timeout -k 10 330 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
2)
  curve() {  # curve NAME DIR: 200 steps of `small` from the package in DIR
    (cd "$2" && OPENK3_CACHE=/tmp/cache-$1 timeout -k 10 450 python3 -m openk3 train --preset small \
      --max-steps 200 --warmup-steps 20 --log-interval 5 --eval-interval 100 --ckpt-interval 100000 \
      --num-samples 0 --out "/tmp/runs/$1" > "$OUT/$1.log" 2>&1; echo "== rc $?" >> "$OUT/$1.log"
     cp "/tmp/runs/$1/metrics.jsonl" "$OUT/$1.metrics.jsonl")
  }
  curve before .before & curve after . &
  timeout -k 10 300 python3 -m pytest -m gpu tests/train/test_graphed.py -x -q -s -p no:cacheprovider \
    -o faulthandler_timeout=240 > "$OUT/gpu_tests.log" 2>&1
  echo "== rc $?" >> "$OUT/gpu_tests.log"
  wait
  ;;
4)  # the graphed step's GPU test alone (phase 2's ran out of time in fla's autotuning)
  timeout -k 5 260 python3 -m pytest -m gpu tests/train/test_graphed.py -x -q -s -p no:cacheprovider \
    -o faulthandler_timeout=250 > "$OUT/gpu_tests.log" 2>&1
  echo "== rc $?" >> "$OUT/gpu_tests.log"
  ;;
*) echo "phase 1, 2 or 4" >&2; exit 2 ;;
esac
summary
