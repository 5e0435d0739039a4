#!/usr/bin/env bash
# The eighth session's device calls on one H200 (only `nvidia-h200` was lent), one warm machine
# across the phases, each call made as soon as the last returns (a machine idle for 30 s is
# released, and P12's phases need what the earlier ones left in /tmp/p12m):
#   run(command="bash benchmarks/device_s8.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (P12): pre-train the base (800 steps) and evaluate it (device_p12_mopd.sh 1).
# 2 (P12, P11): the two RL teachers side by side on the one GPU (device_p12_mopd.sh 2 math | code),
#   then P11's longest sequence `small` trains at without context parallelism on one GPU.
# 3 (P12, P11): the MOPD student beside the teachers' evaluations, the student's evaluation and
#   the table; then P11's 512K row if phase 2 did not reach it.
# Results in docs/benchmarks.md, section "2026-12-01 (eighth session)". Ran: 1, 2 (RL at the old
# default lr 3e-4), then by hand the teachers' evaluations, RL on arithmetic and the student at
# --lr 3e-5 (phase 3 as written was not run: phase 2 had already shown 512K out of memory).
# For the next one-GPU session: device_p12_mopd.sh's phases 1, 2 and 3 (held-out python families,
# lr 3e-5) in three calls made back to back; phase 4 here (P9: LK against KL).
source "$(dirname "$0")/device_common.sh"
cp1() {  # cp1 SECONDS SEQ_LEN...: one process, no CP, rows print as measured
  local limit=$1; shift
  timeout -k 10 "$limit" torchrun --standalone --nproc-per-node 1 benchmarks/kcp_bench.py --dump-after \
    $(( limit - 20 )) model --cp 1 --steps 1 --no-compile --seq-lens "$@" >> "$OUT/kcp_cp1.log" 2>&1
  echo "== rc $?" >> "$OUT/kcp_cp1.log"
}
case "${1:?phase}" in
1) bash benchmarks/device_p12_mopd.sh 1 ;;
2)
  export RL_LIMIT=210
  bash benchmarks/device_p12_mopd.sh 2 math & a=$!
  bash benchmarks/device_p12_mopd.sh 2 code & b=$!
  wait $a $b
  cp1 300 262144 524288
  ;;
3)
  export DISTILL_LIMIT=210
  bash benchmarks/device_p12_mopd.sh distill & a=$!
  bash benchmarks/device_p12_mopd.sh eval-teachers & b=$!
  wait $a $b
  bash benchmarks/device_p12_mopd.sh table
  grep -q "^   1    524288" "$OUT/kcp_cp1.log" 2>/dev/null || cp1 200 524288
  ;;
4)  # P9, for a later one-GPU call (not run): LK against KL on the same budget, both drafts
    # training side by side on the one GPU from the same target + MTP layer, then both in the
    # engine at batch 1 and 8 (the issue's table); ~560 s
  train_run 230 target 1 --preset small --mtp-layers 1 --max-steps 120 --warmup-steps 12 --log-interval 10 \
    --no-compile
  for loss in lk kl; do
    timeout -k 5 160 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/$loss \
      --loss $loss --init mtp --steps 150 --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 10 \
      --save-interval 50 > "$OUT/draft_$loss.log" 2>&1 &
  done
  wait
  for loss in lk kl; do cp /tmp/drafts/$loss/metrics.jsonl "$OUT/draft_$loss.metrics.jsonl" 2>/dev/null; done
  timeout -k 5 150 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    /tmp/drafts/kl --batch 1 8 --K 7 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 \
    --json "$OUT/spec.json" > "$OUT/spec.log" 2>&1; echo "== rc $?" >> "$OUT/spec.log"
  ;;
*) echo "phase 1, 2, 3 or 4" >&2; exit 2 ;;
esac
summary
