#!/usr/bin/env bash
# Issue P9's speed work on the device, in one call on nvidia-h200:
#   run(command="bash benchmarks/device_p9_fast.sh", kind="nvidia-h200",
#       carry=[".whl", ".triton-cache"], timeout_s=598)
# The GPU tests of the fixed-shape verify step, the graphed drafting loops and the paged MLA
# kernel's first position (gpu_tests.log), then spec_bench on `small` with random weights: a random
# EAGLE-3 draft (acceptance ~0: the cost of a verify step) and the target as its own draft model
# (every draft accepted), K = 3 and 7 at batch 1, with a profile of the first configuration
# (spec_fast.log, spec_fast.json, spec_profile.txt). Results in docs/benchmarks.md.
source "$(dirname "$0")/device_common.sh"
gpu_tests 260 tests/serve/test_verify_gpu.py tests/serve/test_engine_gpu.py tests/serve/test_eagle_engine_gpu.py \
  tests/ops/test_paged_mla.py tests/ops/test_kda_rollback.py
timeout -k 5 240 python3 benchmarks/spec_bench.py --preset small --drafts random self --batch 1 --K 3 7 \
  --temperatures 0 --num-prompts 4 --max-tokens 64 --profile --json "$OUT/spec_fast.json" > "$OUT/spec_fast.log" 2>&1
echo "== rc $?" >> "$OUT/spec_fast.log"
summary
