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
# lr 3e-5) in three calls made back to back.
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
*) echo "phase 1, 2 or 3" >&2; exit 2 ;;
esac
summary
