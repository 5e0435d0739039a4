#!/usr/bin/env bash
# The thirty-second session's device calls:
#   run(command="bash benchmarks/device_s39.sh N", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1: where a speculative step's time goes, phase by phase (spec_bench.py --profile's new phase
#    spans: drafting, the verify pass, sampling + commit + host read, the draft's update), with a
#    random EAGLE-3 draft at batch 1, greedy, K = 3 and K = 7.
# 2: the greedy chain in one graph and the KDA verify pass on the pools (causal_conv1d_pooled,
#    kda_verify_pooled): their GPU tests, then spec_bench with the committed eagle.py, verify.py
#    and model/kda.py (.before/, carried) and the new ones, alternated on one machine, with the
#    phase spans of the new code.
# 3: the verified sequences' rollback and the draft's update launched before the host reads the
#    step's results (commit and EAGLE rollback from the device's accepted counts), the MTP layer's
#    residual adds in its output GEMVs: the speculative GPU tests, then spec_bench with the
#    committed package (.before/tree, carried: `git archive HEAD openk3`) and the new one.
# 4: the host reads the verify results behind an event (the rollback runs meanwhile): the random
#    draft's step at K = 3 with its phases and each graph's replay time, then P9's table again: a
#    `small` target with one MTP layer (150 steps), its LK draft (120 steps from the MTP layer),
#    spec_bench at batch 1, K 3 and 7, greedy and temperature 1, held-out prompts.
# 5: the draft chain's layout computed once for all its steps: the speculative GPU tests, then
#    phase 4's target, draft and table again (the random draft's step is in the table's ms/step).
# 6: the random draft's step at K = 3 and 7 with its phases and graph replay times (phase 4's
#    first run) with phase 5's code.
# 7 (written for the next session, not run): the review's shared argument check and fla call of
#    the pooled ops (their GPU tests: decode and verify), the speculative GPU tests, then the P9
#    table at batch 8 too (not measured this session).
source "$(dirname "$0")/device_common.sh"
p9_table() {  # a `small` target with one MTP layer, its LK draft, spec_bench at batch 1
  timeout -s INT -k 30 165 python3 -m openk3 train --preset small --mtp-layers 1 --max-steps 150 --warmup-steps 15 \
    --log-interval 10 --no-compile --eval-interval 100000 --ckpt-interval 100000 --num-samples 0 \
    --out /tmp/runs/target > "$OUT/target.log" 2>&1; echo "== rc $?" >> "$OUT/target.log"
  timeout -s INT -k 30 140 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/lk --loss lk \
    --init mtp --steps 120 --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 10 --save-interval 40 \
    > "$OUT/draft_lk.log" 2>&1; echo "== rc $?" >> "$OUT/draft_lk.log"
  timeout -k 5 120 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 1 --K 7 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --prompts held-out \
    --json "$OUT/spec_lk.json" > "$OUT/spec_lk.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk.log"
}
case "${1:?phase}" in
1)
  for K in 3 7; do
    timeout -k 5 120 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K $K \
      --temperatures 0 --num-prompts 2 --max-tokens 64 --profile --json "$OUT/spec_random_k$K.json" \
      > "$OUT/spec_random_k$K.log" 2>&1; echo "== rc $?" >> "$OUT/spec_random_k$K.log"
    cp "$OUT/spec_profile.txt" "$OUT/spec_profile_k$K.txt"
  done
  ;;
2)
  gpu_tests 200 tests/ops/test_conv.py tests/ops/test_kda_pooled.py -k "pooled_verify or fla_verify"
  gpu_tests 200 tests/serve/test_verify_gpu.py tests/serve/test_eagle_engine_gpu.py
  mkdir -p /tmp/new && cp openk3/serve/eagle.py openk3/serve/verify.py openk3/model/kda.py /tmp/new/
  swap() {  # swap old|new
    local d=/tmp/new; [ "$1" = old ] && d=.before
    cp $d/eagle.py $d/verify.py openk3/serve/; cp $d/kda.py openk3/model/
  }
  for v in old new; do
    swap $v
    prof=""; [ $v = new ] && prof="--profile"
    timeout -k 5 120 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K 3 7 \
      --temperatures 0 --num-prompts 2 --max-tokens 64 $prof --json "$OUT/spec_$v.json" \
      > "$OUT/spec_$v.log" 2>&1; echo "== rc $?" >> "$OUT/spec_$v.log"
  done
  swap new
  ;;
3)
  gpu_tests 250 tests/serve/test_verify_gpu.py tests/serve/test_eagle_engine_gpu.py \
    "tests/serve/test_engine_gpu.py::test_engine_logprobs_match_full_forward[True-3]"
  for v in old new; do
    path=$PWD; prof="--profile"; [ $v = old ] && path=$PWD/.before/tree && prof=""
    PYTHONPATH=/tmp/site:$path timeout -k 5 120 python3 benchmarks/spec_bench.py --preset small --drafts random \
      --batch 1 --K 3 7 --temperatures 0 --num-prompts 2 --max-tokens 64 $prof --json "$OUT/spec_$v.json" \
      > "$OUT/spec_$v.log" 2>&1; echo "== rc $?" >> "$OUT/spec_$v.log"
  done
  ;;
4)
  timeout -k 5 80 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K 3 \
    --temperatures 0 --num-prompts 2 --max-tokens 64 --profile --json "$OUT/spec_random.json" \
    > "$OUT/spec_random.log" 2>&1; echo "== rc $?" >> "$OUT/spec_random.log"
  p9_table
  ;;
5)
  gpu_tests 130 tests/serve/test_verify_gpu.py tests/serve/test_eagle_engine_gpu.py
  p9_table
  ;;
6)
  timeout -k 5 100 python3 benchmarks/spec_bench.py --preset small --drafts random --batch 1 --K 3 7 \
    --temperatures 0 --num-prompts 1 --max-tokens 64 --profile --json "$OUT/spec_random.json" \
    > "$OUT/spec_random.log" 2>&1; echo "== rc $?" >> "$OUT/spec_random.log"
  ;;
7)
  gpu_tests 120 tests/ops/test_conv.py tests/ops/test_kda_pooled.py -k "pooled or fla"
  gpu_tests 150 tests/serve/test_verify_gpu.py tests/serve/test_eagle_engine_gpu.py
  p9_table
  timeout -k 5 120 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    --batch 8 --K 7 3 --temperatures 0 1 --num-prompts 16 --max-tokens 128 --prompts held-out \
    --json "$OUT/spec_lk_b8.json" > "$OUT/spec_lk_b8.log" 2>&1; echo "== rc $?" >> "$OUT/spec_lk_b8.log"
  ;;
*) echo "phase 1 to 7" >&2; exit 2 ;;
esac
summary
