#!/usr/bin/env bash
# The twenty-fifth session's device calls:
#   run(command="bash benchmarks/device_s33.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the merged branch decode-down-sum (the routed experts' down GEMV and slot sum in one kernel)
#    and the grouped kernels' `_tile` helper: their GPU tests, moe_decode_bench.py, the batch-1
#    census, serve_bench.py --parts decode server.
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
*) echo "phase 1" >&2; exit 2 ;;
esac
summary
