#!/usr/bin/env bash
# The ninth session's device calls on one H200 (only `nvidia-h200` was lent), one warm machine
# across the phases, each call made as soon as the last returns (a machine idle for 30 s is
# released, and P12's phases need what the earlier ones left in /tmp/p12m):
#   run(command="bash benchmarks/device_s9.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (P12): pre-train the base on text without four python families, evaluate it
#    (device_p12_mopd.sh 1; ~450 s).
# 2 (P12 + P9): the three RL teachers side by side, then their evaluations (device_p12_mopd.sh 2,
#    ~300 s), beside P9's LK against KL (device_s8.sh 4: target + MTP layer, both drafts, the
#    engine at batch 1 and 8; ~560 s). Each is host-bound on its own (small batches), which is
#    why they share the GPU; their times are not comparable with runs made alone.
# 3 (P12): the MOPD student from the better math teacher and the code teacher, its evaluation, the
#    table (device_p12_mopd.sh 3; ~350 s).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1) bash benchmarks/device_p12_mopd.sh 1 ;;
2)
  bash benchmarks/device_p12_mopd.sh 2 & a=$!
  bash benchmarks/device_s8.sh 4 & b=$!
  wait $a $b
  ;;
3)  # with P9's drafts and engine measurement again (their first try, beside phase 2, made no step in 170 s)
  bash benchmarks/device_p12_mopd.sh 3 & a=$!
  SKIP_TARGET=1 bash benchmarks/device_s8.sh 4 & b=$!
  wait $a $b
  ;;
*) echo "phase 1, 2 or 3" >&2; exit 2 ;;
esac
summary
