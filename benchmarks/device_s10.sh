#!/usr/bin/env bash
# The next one-GPU session's device calls (written in the ninth): P12 with a base that solves the
# rare parts of its tasks only sometimes, and P9 with a target trained ~4x longer, its LK draft
# ~3x longer, measured on prompts it did not train on too. One warm machine across the phases,
# each call made as soon as the last returns (a machine idle for 30 s is released; the phases
# need what the earlier ones left in /tmp/p12m and /tmp/runs):
#   run(command="bash benchmarks/device_s10.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (P12): solved text with rare parts, pre-train the base, evaluate it (device_p12_mopd.sh 1; ~560 s).
# 2 (P12 + P9): the three RL teachers and their evaluations (device_p12_mopd.sh 2; ~430 s) beside
#    P9's target: `small` + one MTP layer for up to 500 steps of 4 x 4096 tokens, stopped by
#    SIGINT at 440 s (saved and exported); the ninth session's had 120 (loss 2.98, val 2.18).
# 3 (P12 + P9): the MOPD student and its evaluation and the table (device_p12_mopd.sh 3; ~340 s)
#    beside the LK draft from the target's MTP layer (up to 300 steps, stopped by SIGINT at 330 s,
#    saved), then, alone on the GPU so that its step times mean something, spec_bench at batch 1
#    on the corpus's prompts and on held-out ones (openk3's own source; ~150 s).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1) bash benchmarks/device_p12_mopd.sh 1 ;;
2)  # RL's limit 240 -> 280 s: the python teacher needed ~225 s for its 60 steps alone (ninth session)
  RL_LIMIT=280 bash benchmarks/device_p12_mopd.sh 2 & a=$!
  timeout -s INT -k 60 440 python3 -m openk3 train --preset small --mtp-layers 1 --max-steps 500 --warmup-steps 25 \
    --log-interval 20 --no-compile --eval-interval 100000 --ckpt-interval 100000 --num-samples 0 \
    --out /tmp/runs/target > "$OUT/target.log" 2>&1; echo "== rc $?" >> "$OUT/target.log"
  cp /tmp/runs/target/metrics.jsonl "$OUT/target.metrics.jsonl" 2>/dev/null
  wait $a
  ;;
3)
  bash benchmarks/device_p12_mopd.sh 3 & a=$!
  rm -rf /tmp/drafts/lk
  timeout -s INT -k 60 330 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/lk --loss lk \
    --init mtp --steps 300 --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 10 --save-interval 50 \
    > "$OUT/draft_lk.log" 2>&1; echo "== rc $?" >> "$OUT/draft_lk.log"
  cp /tmp/drafts/lk/metrics.jsonl "$OUT/draft_lk.metrics.jsonl" 2>/dev/null
  wait $a
  for prompts in corpus held-out; do
    timeout -k 5 90 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
      --batch 1 --K 7 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --prompts $prompts \
      --json "$OUT/spec_$prompts.json" > "$OUT/spec_$prompts.log" 2>&1; echo "== rc $?" >> "$OUT/spec_$prompts.log"
  done
  ;;
*) echo "phase 1, 2 or 3" >&2; exit 2 ;;
esac
summary
