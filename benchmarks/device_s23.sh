#!/usr/bin/env bash
# The seventeenth session's device calls:
#   run(command="bash benchmarks/device_s23.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1 (nvidia-h200): run-to-run determinism of the router logits and of a training forward
#    (benchmarks/determinism.py: test_graphed's GPU test failed with the split logits), then P8's
#    decode step against the peer and its census (device_s21.sh 2).
# 2 (nvidia-h200): test_graphed's GPU test as changed, then tests/parallel/test_compile.py.
# 3 (nvidia-h200): determinism.py again, with random values in the allocator's free blocks and
#    the first training step of fresh instances of one model (run before 2).
source "$(dirname "$0")/device_common.sh"
determinism() {  # the op cases and the model with either router logits, side by side
  timeout -k 10 200 python3 benchmarks/determinism.py ops > "$OUT/determinism_ops.log" 2>&1 &
  for b in auto torch; do
    timeout -k 10 200 python3 benchmarks/determinism.py model $b > "$OUT/determinism_$b.log" 2>&1 &
  done
  wait
  cat "$OUT"/determinism_*.log | grep -E "distinct|first steps"
}
case "${1:?phase}" in
1) determinism; bash benchmarks/device_s21.sh 2 ;;
3) determinism ;;
2)
  gpu_tests 150 tests/train/test_graphed.py
  gpu_tests 330 tests/parallel/test_compile.py
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
