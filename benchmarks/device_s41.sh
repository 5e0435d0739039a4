#!/usr/bin/env bash
# The thirty-fourth session's device calls:
#   run(command="bash benchmarks/device_s41.sh N", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1: the EAGLE and graph GPU tests after the chains were merged (EagleDrafter._chain), beside a
#    `small` target with one MTP layer trained 4x longer than the thirty-third session's (600
#    steps), then its LK draft from the MTP layer (400 steps, the default), kept in /tmp.
# 2: on the same (warm) machine, spec_bench at batch 1 with K = 7, 5 and 3, greedy and temperature
#    1, held-out prompts, then batch 8 at K = 3.
# 3: P8's server over the engine with 8 and 16 client processes (the official client's threads
#    and its async client, and the raw client), four server processes; then warm/cold TTFT.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  (GPU_LOG=gpu_tests gpu_tests 200 tests/serve/test_eagle_engine_gpu.py tests/serve/test_graphs_gpu.py --durations=5) &
  start=$SECONDS
  timeout -s INT -k 30 300 python3 -m openk3 train --preset small --mtp-layers 1 --max-steps 600 --warmup-steps 30 \
    --log-interval 25 --no-compile --eval-interval 300 --ckpt-interval 100000 --num-samples 0 \
    --out /tmp/runs/target > "$OUT/target.log" 2>&1; echo "== rc $? after $((SECONDS - start)) s" >> "$OUT/target.log"
  wait
  start=$SECONDS
  timeout -s INT -k 30 $((560 - SECONDS)) python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/lk \
    --loss lk --init mtp --steps 400 --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 20 --save-interval 50 \
    > "$OUT/draft_lk.log" 2>&1; echo "== rc $? after $((SECONDS - start)) s" >> "$OUT/draft_lk.log"
  ;;
2)
  [ -d /tmp/runs/target ] && [ -d /tmp/drafts/lk ] || { echo "not the warm machine of phase 1"; exit 3; }
  timeout -k 5 200 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 1 --K 7 5 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --prompts held-out \
    --json "$OUT/spec_lk.json" > "$OUT/spec_lk.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk.log"
  timeout -k 5 100 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 8 --K 3 --temperatures 0 1 --num-prompts 16 --max-tokens 128 --prompts held-out \
    --json "$OUT/spec_lk_b8.json" > "$OUT/spec_lk_b8.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk_b8.log"
  ;;
3)
  timeout -k 5 420 python3 benchmarks/serve_bench.py --parts server ttft --client-procs 8 16 --server-engines process \
    --api-servers 4 --clients threads async raw > "$OUT/server.log" 2>&1
  echo "== rc $?" >> "$OUT/server.log"
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
