#!/usr/bin/env bash
# The seventh session's device calls on nvidia-h200-x2, one warm machine across the phases:
#   run(command="bash benchmarks/device_s7.sh N", kind="nvidia-h200-x2", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (P11, P7): the 2-GPU context-parallel test beside the sharded-checkpoint test; `small`
#   training at 128K-512K tokens per sequence with --cp 2 (the 512K target) and at 256K without;
#   one KDA layer at 256K tokens: openk3's KCP (both methods) against fla's cp_context.
# 2 (P12, P9 side by side): GPU 0 pre-trains P12's base and evaluates it (device_p12_mopd.sh 1);
#   GPU 1 runs device_s6.sh 3 (target + MTP, a draft unrolled over 7 depths, spec_bench).
# 3 (P12): the two RL teachers side by side, then the MOPD student on GPU 0 beside the teachers'
#   evaluations on GPU 1, then the table. Needs phase 2's base on this warm machine.
# 4 (P11, the session's last 700 s): phase 1 printed nothing within its limits (fla autotuning on a
#   fresh machine, two processes per GPU; the caches it left are in the committed autotune tgz):
#   --cp 2 alone with a longer limit and stack dumps, then the KDA comparison, then the test.
# Results in docs/benchmarks.md, section "2026-12-01 (seventh session)". Ran: 1, 2 (P12's base
# at 300 pre-training steps; now 800), 4. For the next session: 4 (P11, with the flash-attention
# fix), then 2 and 3 with no pause between the calls (a machine idle for 30 s is released, and
# phase 3 needs phase 2's base).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  ( GPU_LOG=t_cp gpu_tests 150 -s tests/parallel/test_context_parallel.py ) & a=$!
  ( GPU_LOG=t_dcp gpu_tests 100 tests/train/test_checkpoint_dcp.py ) & b=$!
  wait $a $b
  model() {  # model SECONDS NAME CP SEQ_LEN...: rows print as measured; an OOM ends the list
    local limit=$1 name=$2 cp=$3; shift 3
    timeout -k 10 "$limit" torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py model \
      --cp "$cp" --steps 1 --no-compile --seq-lens "$@" > "$OUT/$name.log" 2>&1
    echo "== rc $?" >> "$OUT/$name.log"
  }
  model 210 kcp_model_cp2 2 131072 262144 524288
  timeout -k 5 60 torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py kda --seq-len 262144 \
    > "$OUT/kcp_kda.log" 2>&1; echo "== rc $?" >> "$OUT/kcp_kda.log"
  model 100 kcp_model_cp1 1 262144 524288
  ;;
2)
  ( export CUDA_VISIBLE_DEVICES=0; bash benchmarks/device_p12_mopd.sh 1 ) & a=$!
  ( export CUDA_VISIBLE_DEVICES=1; bash benchmarks/device_s6.sh 3 ) & b=$!
  wait $a $b
  ;;
3)
  export RL_LIMIT=200 DISTILL_LIMIT=200
  ( export CUDA_VISIBLE_DEVICES=0; bash benchmarks/device_p12_mopd.sh 2 math ) & a=$!
  ( export CUDA_VISIBLE_DEVICES=1; bash benchmarks/device_p12_mopd.sh 2 code ) & b=$!
  wait $a $b
  ( export CUDA_VISIBLE_DEVICES=0; bash benchmarks/device_p12_mopd.sh distill ) & a=$!
  ( export CUDA_VISIBLE_DEVICES=1; bash benchmarks/device_p12_mopd.sh eval-teachers ) & b=$!
  wait $a $b
  bash benchmarks/device_p12_mopd.sh table
  ;;
4)
  timeout -k 10 320 torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py --dump-after 290 model \
    --cp 2 --steps 1 --no-compile --seq-lens 131072 262144 524288 > "$OUT/kcp_model_cp2.log" 2>&1
  echo "== rc $?" >> "$OUT/kcp_model_cp2.log"
  timeout -k 5 90 torchrun --standalone --nproc-per-node 2 benchmarks/kcp_bench.py --dump-after 80 kda \
    --seq-len 262144 > "$OUT/kcp_kda.log" 2>&1; echo "== rc $?" >> "$OUT/kcp_kda.log"
  GPU_LOG=t_cp gpu_tests 100 -s tests/parallel/test_context_parallel.py
  ;;
*) echo "phase 1, 2, 3 or 4" >&2; exit 2 ;;
esac
summary
