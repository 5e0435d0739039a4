#!/usr/bin/env bash
# The twenty-fifth session's device calls:
#   run(command="bash benchmarks/device_s33.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the merged branch decode-down-sum (the routed experts' down GEMV and slot sum in one kernel)
#    and the grouped kernels' `_tile` helper: their GPU tests, moe_decode_bench.py, the batch-1
#    census, serve_bench.py --parts decode server.
# 2: the server against the engine with the engine's step log, at three GIL switch intervals;
#    server_host_bench.py (the model stubbed, 4.5 ms a step) at two; the routed experts' GEMVs
#    against the grouped Triton kernels at more batch sizes, `small` and K3 (GEMV_MAX_PAIRS).
#    Run from a snapshot of HEAD (helpers edit the working tree):
#    run(command="rm -rf .snap && mkdir .snap && ... ; cd .snap && bash benchmarks/device_s33.sh 2")
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 150 tests/ops/test_moe.py -k "gemv or routed_experts or triton_reads or grouped or group_pairs"
  timeout -k 5 90 python3 benchmarks/moe_decode_bench.py --presets small --tokens 1 8 32 128 > "$OUT/moe_decode.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_decode.log"
  timeout -k 5 90 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  timeout -k 5 200 python3 benchmarks/serve_bench.py --parts decode server > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)
  timeout -k 5 150 python3 benchmarks/serve_bench.py --parts server --client-procs 8 \
    --switch-intervals 0.005 0.001 0.0002 > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  for si in 0.005 0.0005; do
    timeout -k 5 100 python3 -m benchmarks.server_host_bench --repeats 2 --gpu-ms 4.5 --client threads \
      --client-procs 8 --switch-interval $si > "$OUT/host_$si.log" 2>&1
    echo "== rc $?" >> "$OUT/host_$si.log"
  done
  timeout -k 5 150 python3 benchmarks/moe_decode_bench.py --presets small k3 --tokens 1 8 16 32 64 128 \
    > "$OUT/moe_decode.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_decode.log"
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
