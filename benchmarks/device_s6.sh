#!/usr/bin/env bash
# The sixth session's device calls on nvidia-h200 (one GPU), by phase:
#   run(command="bash benchmarks/device_s6.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (P9): the GPU tests that failed in the session's first call (the fixed-shape drafting loops,
#   the paged MLA kernel's first positions), each file in a process of its own, while `small`
#   with one MTP layer trains on the corpus; then its EAGLE-3 draft (LK loss, from the MTP
#   layer) and the draft in the engine against plain decoding (spec_bench.py). The call ran out
#   of time: training ended inside its limit before writing export/ (the draft needs it), and a
#   bare `wait` waited for the result saver.
# 2 (P9): the training, the draft and spec_bench of phase 1, shortened to fit one call.
# 3 (P9, not run yet): phase 2 with a draft trained over 7 unrolled depths for 200 steps, and
#   the profile: what the next session should run first.
# Results in docs/benchmarks.md, section "2026-12-01 (sixth session)".
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  ( GPU_LOG=t_verify gpu_tests 200 tests/serve/test_verify_gpu.py ) & t1=$!
  ( GPU_LOG=t_paged_mla gpu_tests 200 tests/ops/test_paged_mla.py ) & t2=$!
  train_run 230 target 1 --preset small --mtp-layers 1 --max-steps 120 --warmup-steps 12 --log-interval 10 \
    --ckpt-interval 60 --no-compile
  wait $t1 $t2
  ;;
2)  # phase 1's P9 part again, without the tests, the interval checkpoint or batch 8
  # on the machine phase 1 left warm, its run (checkpointed at step 60 or 120) resumes to 120 and exports
  resume=(); [ -d /tmp/runs/target ] && resume=(--resume)
  train_run 250 target 1 --preset small --mtp-layers 1 --max-steps 120 --warmup-steps 12 --log-interval 10 \
    --no-compile "${resume[@]}"
  timeout -k 5 110 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/lk \
    --loss lk --init mtp --steps 80 --batch-size 8 --seq-len 512 --log-interval 10 --save-interval 40 \
    > "$OUT/draft_lk.log" 2>&1; echo "== rc $?" >> "$OUT/draft_lk.log"
  cp /tmp/drafts/lk/metrics.jsonl "$OUT/draft_lk.metrics.jsonl" 2>/dev/null
  timeout -k 5 125 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 1 --K 7 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --json "$OUT/spec_lk.json" \
    > "$OUT/spec_lk.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk.log"
  ;;
3)  # P9 again for the next session (nothing survives a cold machine): the target, then a draft
    # trained longer and unrolled over 7 depths (the K it serves), then spec_bench at temperature 0
    # and 1 (the sampler no longer sorts the vocabulary without top-k/top-p) with a profile
  train_run 250 target 1 --preset small --mtp-layers 1 --max-steps 120 --warmup-steps 12 --log-interval 10 \
    --no-compile
  timeout -k 5 170 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/lk7 \
    --loss lk --init mtp --steps 200 --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 10 \
    --save-interval 50 > "$OUT/draft_lk7.log" 2>&1; echo "== rc $?" >> "$OUT/draft_lk7.log"
  cp /tmp/drafts/lk7/metrics.jsonl "$OUT/draft_lk7.metrics.jsonl" 2>/dev/null
  timeout -k 5 120 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk7 \
    --batch 1 --K 7 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --profile \
    --json "$OUT/spec_lk7.json" > "$OUT/spec_lk7.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk7.log"
  ;;
esac
summary
