#!/usr/bin/env bash
# The twenty-fifth session's device calls:
#   run(command="bash benchmarks/device_s33.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the merged branch decode-down-sum (the routed experts' down GEMV and slot sum in one kernel)
#    and the grouped kernels' `_tile` helper: their GPU tests, moe_decode_bench.py, the batch-1
#    census, serve_bench.py --parts decode server.
# 2: the server against the engine: over AsyncEngine (engine steps logged) at three GIL switch
#    intervals and over ProcessEngine (the engine in its own process); the fused router (route):
#    its GPU tests and moe_decode_bench.py --router; the routed experts' GEMVs against the grouped
#    Triton kernels at more batch sizes, `small` and K3 (GEMV_MAX_PAIRS); the batch-1 census and
#    decode. Run from a snapshot (.snap: HEAD plus Router.forward calling route; helpers edit the
#    working tree):
#    run(command="for d in .whl .triton-cache .warm; do ln -s ../$d .snap/$d; done; cd .snap &&
#        bash benchmarks/device_s33.sh 2", carry=[".whl", ".triton-cache", ".warm", ".snap"])
# 3: the fused router reverted, GEMV_MAX_PAIRS 64; graphs captured before serving
#    (capture_graphs); the MoE output kernel (moe_output): GPU tests of each, moe_output_bench.py,
#    serve_bench.py --parts decode server (every engine captures first), the batch-1 census.
#    Run from a snapshot of HEAD (.snap), as phase 2.
# 4: the MoE output kernel reverted; the capture test mended: its GPU test, the server over both
#    engines twice (the rounds' spread), batch-1 decode. Run from a snapshot of HEAD (.snap).
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
  gpu_tests 120 tests/ops/test_router.py
  timeout -k 5 60 python3 benchmarks/moe_decode_bench.py --router --presets small k3 --tokens 1 8 32 \
    > "$OUT/router.log" 2>&1
  echo "== rc $?" >> "$OUT/router.log"
  timeout -k 5 200 python3 benchmarks/serve_bench.py --parts decode server --client-procs 8 \
    --switch-intervals 0.005 0.0005 > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 5 60 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  timeout -k 5 120 python3 benchmarks/moe_decode_bench.py --presets small k3 --tokens 1 8 16 32 64 128 \
    > "$OUT/moe_decode.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_decode.log"
  ;;
3)
  gpu_tests 240 tests/ops/test_moe_output.py tests/serve/test_engine_gpu.py tests/ops/test_moe.py \
    tests/ops/test_mx_kernels.py -k "moe_output or fused or graphs_captured or cuda_graph_decode \
    or routed_experts or gemv or grouped_triton_is_no_worse or logprobs_match"
  timeout -k 5 60 python3 benchmarks/moe_output_bench.py > "$OUT/moe_output.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_output.log"
  timeout -k 5 240 python3 benchmarks/serve_bench.py --parts decode server --client-procs 8 \
    --switch-intervals 0.005 0.0005 > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 5 60 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  ;;
4)
  gpu_tests 150 tests/serve/test_engine_gpu.py -k "graphs_captured"
  timeout -k 5 300 python3 benchmarks/serve_bench.py --parts decode server --client-procs 8 8 \
    --switch-intervals 0.0005 > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
