#!/usr/bin/env bash
# Issue P12 (partial rollouts) on one H200, in one call:
#   run(command="bash benchmarks/device_p12.sh", kind="nvidia-h200", carry=[".whl", ".triton-cache"],
#       timeout_s=598)
# benchmarks/rollout_bench.py on `small` under a heavy and a light length tail (sync vs partial
# rollouts, a steady state of RL steps), then the post-training GPU tests. Each benchmark is
# sized to finish in ~150 s; rows are printed as each mode ends, so a run cut short still says
# something. Results in docs/benchmarks.md.
source "$(dirname "$0")/device_common.sh"
bench() {  # bench NAME SECONDS FLAGS...
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" python3 benchmarks/rollout_bench.py --preset small --device cuda "$@" \
    > "$OUT/rollout_$name.log" 2>&1
  echo "== rc $?" >> "$OUT/rollout_$name.log"
}
bench heavy1024 170 --lengths heavy --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --steps 6 \
  --finish-fraction 0.5 0.75
bench light512 150 --lengths light --prompts-per-step 32 --group-size 8 --max-new-tokens 512 --steps 5 \
  --finish-fraction 0.75
bench heavy2048 170 --lengths heavy --prompts-per-step 16 --group-size 8 --max-new-tokens 2048 --steps 5 \
  --finish-fraction 0.5
gpu_tests 60 tests/posttrain
summary
