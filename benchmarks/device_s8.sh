#!/usr/bin/env bash
# The eighth session's device calls on one H200 (only `nvidia-h200` was lent), one warm machine
# across the phases, each call made as soon as the last returns (a machine idle for 30 s is
# released, and P12's phases need what the earlier ones left in /tmp/p12m):
#   run(command="bash benchmarks/device_s8.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (P12): pre-train the base and evaluate it (device_p12_mopd.sh 1).
# 2 (P12): the two RL teachers side by side on the one GPU (device_p12_mopd.sh 2 math | code).
# 3 (P12): the MOPD student beside the teachers' evaluations, the student's evaluation, the table.
# 4 (P9): LK against KL on the same budget (needs nothing).
# Results in docs/benchmarks.md, section "2026-12-01 (eighth session)". Ran: 1 and 2 as they were
# then (800 pre-training steps on every python family; RL at the old default lr 3e-4; phase 2 then
# also ran P11's `kcp_bench.py model --cp 1` at 256K and 512K on one process), then by hand the
# teachers' evaluations, RL on arithmetic and the student at --lr 3e-5. For the next one-GPU
# session: 1, 2, 3 back to back (python families held out of pre-training, lr 3e-5), then 4.
# Checked on the CPU (2026-12-01) with PRESET=debug DEVICE=cpu and a few steps per stage.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1) bash benchmarks/device_p12_mopd.sh 1 ;;
2)
  bash benchmarks/device_p12_mopd.sh 2 math & a=$!
  bash benchmarks/device_p12_mopd.sh 2 code & b=$!
  wait $a $b
  ;;
3)
  bash benchmarks/device_p12_mopd.sh distill & a=$!
  bash benchmarks/device_p12_mopd.sh eval-teachers & b=$!
  wait $a $b
  bash benchmarks/device_p12_mopd.sh table
  ;;
4)  # both drafts train side by side on the one GPU from the same target + MTP layer, then both
    # run in the engine at batch 1 and 8 (the issue's table); ~560 s
  [ -n "${SKIP_TARGET:-}" ] || train_run 230 target 1 --preset small --mtp-layers 1 --max-steps 120 \
    --warmup-steps 12 --log-interval 10 --no-compile
  pids=()  # not a bare `wait`: it would wait for device_common's result saver too
  for loss in lk kl; do
    timeout -k 5 170 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/$loss \
      --loss $loss --init mtp --steps 100 --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 10 \
      --save-interval 25 > "$OUT/draft_$loss.log" 2>&1 & pids+=($!)
  done
  wait "${pids[@]}"
  for loss in lk kl; do cp /tmp/drafts/$loss/metrics.jsonl "$OUT/draft_$loss.metrics.jsonl" 2>/dev/null; done
  timeout -k 5 150 python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts /tmp/drafts/lk \
    /tmp/drafts/kl --batch 1 8 --K 7 3 --temperatures 0 1 --num-prompts 8 --max-tokens 128 \
    --json "$OUT/spec.json" > "$OUT/spec.log" 2>&1; echo "== rc $?" >> "$OUT/spec.log"
  ;;
*) echo "phase 1, 2, 3 or 4" >&2; exit 2 ;;
esac
summary
