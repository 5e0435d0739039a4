#!/usr/bin/env bash
# Prepared by the thirty-fifth session for the next one's device calls (not run yet):
#   run(command="bash benchmarks/device_s43.sh N", carry=[".whl", ".triton-cache"], timeout_s=N's limit)
# 1 (~400 s): the routing kernels' histogram tile, widest (what group_pairs launches since the
#    thirty-fifth session: one compile for every size) against the narrowest the blocks fit (the
#    old launch), 32 to 32,768 tokens (moe_route_bench.py); the final version of the compile test
#    (the kernels' caches emptied first) and the graphs' tests; then compile_watch.py: Triton
#    compiles inside serving steps for prompts of 17-6,000 tokens, plain and with an EAGLE draft.
# 2 (~480 s): P9's 150-step target with a draft trained 400 steps instead of 120 (does more draft
#    training raise acceptance? at 120 steps it moved between 0.65 and 0.77 over the last 30), then
#    spec_bench at batch 1, K = 3 and 7, greedy and temperature 1, held-out prompts.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 120 python3 benchmarks/moe_route_bench.py > "$OUT/moe_route.log" 2>&1; echo "== rc $?" >> "$OUT/moe_route.log"
  gpu_tests 120 tests/ops/test_moe.py tests/serve/test_graphs_gpu.py --durations=5
  timeout -k 5 120 python3 benchmarks/compile_watch.py > "$OUT/compile_watch.log" 2>&1; echo "== rc $?" >> "$OUT/compile_watch.log"
  timeout -k 5 120 python3 benchmarks/compile_watch.py --draft random > "$OUT/compile_watch_eagle.log" 2>&1
  echo "== rc $?" >> "$OUT/compile_watch_eagle.log"
  ;;
2)
  p9_target_and_draft 400 260
  timeout -k 5 $((590 - SECONDS)) python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 1 --K 3 7 --temperatures 0 1 --num-prompts 16 --max-tokens 128 --prompts held-out \
    --json "$OUT/spec_lk.json" > "$OUT/spec_lk.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk.log"
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
