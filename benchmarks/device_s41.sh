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
# 4: the speculative graphs captured up front (LLMEngine.capture_graphs: verify, draft chains,
#    draft update of every decode bucket): the EAGLE, verify and capture GPU tests beside a
#    150-step `small` target with one MTP layer, then its LK draft (120 steps), then spec_bench at
#    batch 1 and 8, K = 3, greedy and temperature 1 (spec_bench now captures first, as openk3 serve).
# 5: where a run's time outside the steady steps goes (spec_bench's other_s, slowest_other): a
#    random draft at batch 1, K = 3, temperature 1 then 0, 16 prompts (phase 4's plain engine at
#    temperature 1 spent ~6 s outside its steps).
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
4)
  (gpu_tests 230 tests/serve/test_eagle_engine_gpu.py tests/serve/test_verify_gpu.py \
     "tests/serve/test_engine_gpu.py::test_graphs_captured_at_start_serve_as_those_captured_on_first_use" --durations=8) &
  p9_target_and_draft
  wait
  timeout -k 5 200 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 8 1 --K 3 --temperatures 0 1 --num-prompts 16 --max-tokens 128 --prompts held-out \
    > "$OUT/spec_lk.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk.log"
  ;;
5)
  timeout -k 5 130 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K 3 --temperatures 1 0 \
    --num-prompts 16 --max-tokens 128 --json "$OUT/spec_random.json" > "$OUT/spec_random.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_random.log"
  python3 -c "import json; [print({k: r.get(k) for k in ('draft', 'temperature', 'K', 'seconds', 'tok_s', 'ms_per_step', 'steady_steps', 'other_steps', 'other_s', 'slowest_other')}) for r in json.load(open('$OUT/spec_random.json'))['rows']]" >> "$OUT/spec_random.log" 2>&1
  ;;
*) echo "phase 1 to 5" >&2; exit 2 ;;
esac
summary
