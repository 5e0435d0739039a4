#!/usr/bin/env bash
# The thirty-fifth session's device calls:
#   run(command="bash benchmarks/device_s42.sh N", carry=[".whl", ".triton-cache"], timeout_s=N's limit)
# 1 (~250 s): where a run's time outside its steady steps goes (spec_bench --profile-other:
#    cProfile over the prefills and admissions): a random draft on `small` at batch 1, K = 3,
#    temperature 1 then 0 (the thirty-fourth session's plain engine at temperature 1 spent ~6 s
#    outside its steps), and at batch 8, greedy (its speculative engine ~1.1 s).
# 2 (~280 s): the four engines of phase 1's batch-1 run in one process with the old capture
#    (garbage collected during it) and with graphs.quiet_collector (the collector off during
#    captures: nothing failed either way, and the guard was dropped, so the two runs are now the
#    same), the Triton compiles of the timed runs logged (--profile-other); batch 8 again; the
#    graphs' GPU test.
# 3 (~450 s): the routing kernels' token counts without new compiles (do_not_specialize) and
#    the captures without collections: the GPU tests beside P9's 150-step target and its LK draft,
#    then spec_bench at batch 8 and 1, K = 3, greedy and temperature 1, held-out prompts.
# 4 (~150 s): phase 3's batch-8 greedy run spent 0.59 s in one admission step (256 prompt
#    tokens beside 7 verifying): a random draft at batch 8, temperature 1 and 0, 32 prompts, with
#    --profile-other.
# 5 (~200 s): the routing kernel's histogram tile at its widest for every size (one compile):
#    the MoE kernels' GPU tests, then phase 4's temperature-1 run again.
source "$(dirname "$0")/device_common.sh"
rows() {  # each run's time outside its steady steps
  for f in "$OUT"/spec_b*.json; do
    python3 -c "import json, sys; [print({k: r.get(k) for k in ('draft', 'temperature', 'batch', 'K', 'seconds', 'tok_s', 'ms_per_step', 'steady_steps', 'other_steps', 'other_s', 'slowest_other')}) for r in json.load(open(sys.argv[1]))['rows']]" "$f" >> "$OUT/rows.log" 2>&1
  done
}
case "${1:?phase}" in
1)
  timeout -k 5 130 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K 3 --temperatures 1 0 \
    --num-prompts 16 --max-tokens 128 --profile-other --json "$OUT/spec_b1.json" > "$OUT/spec_b1.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_b1.log"
  timeout -k 5 100 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 8 --K 3 --temperatures 0 \
    --num-prompts 16 --max-tokens 128 --profile-other --json "$OUT/spec_b8.json" > "$OUT/spec_b8.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_b8.log"
  rows
  ;;
2)
  # the same four engines in one process with the old capture (no quiet_collector), then with it
  # and Triton's compiles logged; batch 8 again; then the graphs' GPU test
  timeout -k 5 110 python3 -c "import contextlib, sys, openk3.serve.graphs as g, benchmarks.spec_bench as b
g.quiet_collector = contextlib.nullcontext
sys.exit(b.main(sys.argv[1:]))" --preset small --drafts random --batch 1 --K 3 --temperatures 1 0 --num-prompts 16 \
    --max-tokens 128 > "$OUT/old_capture.log" 2>&1; echo "== rc $?" >> "$OUT/old_capture.log"
  timeout -k 5 130 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K 3 --temperatures 1 0 \
    --num-prompts 16 --max-tokens 128 --profile-other --json "$OUT/spec_b1.json" > "$OUT/spec_b1.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_b1.log"
  timeout -k 5 100 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 8 --K 3 --temperatures 0 \
    --num-prompts 16 --max-tokens 128 --profile-other --json "$OUT/spec_b8.json" > "$OUT/spec_b8.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_b8.log"
  rows
  gpu_tests 60 tests/serve/test_graphs_gpu.py
  ;;
3)
  (gpu_tests 200 tests/ops/test_moe.py tests/serve/test_graphs_gpu.py \
     "tests/serve/test_engine_gpu.py::test_graphs_captured_at_start_serve_as_those_captured_on_first_use" \
     "tests/serve/test_eagle_engine_gpu.py::test_speculative_graphs_captured_at_start_serve_as_those_captured_on_first_use" \
     --durations=5) &
  p9_target_and_draft
  wait
  timeout -k 5 200 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 8 1 --K 3 --temperatures 0 1 --num-prompts 16 --max-tokens 128 --prompts held-out \
    --json "$OUT/spec_b81.json" > "$OUT/spec_lk.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk.log"
  rows
  ;;
4)
  timeout -k 5 150 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 8 --K 3 --temperatures 1 0 \
    --num-prompts 32 --max-tokens 128 --profile-other --json "$OUT/spec_b8.json" > "$OUT/spec_b8.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_b8.log"
  rows
  ;;
5)
  gpu_tests 120 tests/ops/test_moe.py -k "token_counts or group_pairs or combine or grouped"
  timeout -k 5 100 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 8 --K 3 --temperatures 1 \
    --num-prompts 32 --max-tokens 128 --profile-other --json "$OUT/spec_b8.json" > "$OUT/spec_b8.log" 2>&1
  echo "== rc $?" >> "$OUT/spec_b8.log"
  rows
  ;;
*) echo "phase 1 to 5" >&2; exit 2 ;;
esac
summary
