#!/usr/bin/env bash
# The twenty-fourth session's device calls:
#   run(command="bash benchmarks/device_s32.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: benchmarks/warm_timeline.py (a warm request's host and GPU timeline without a profiler,
#    and its synchronising calls).
# 2: the expert order in two Triton kernels (group_pairs) and the attention batch computed after
#    the first prefill graph piece: their GPU tests, moe_route_bench.py, the timeline again and
#    serve_bench.py --parts ttft (cold and warm in one run); the varlen convolution's kernel
#    rewritten (state taps only in tiles that need them, 32-bit offsets): its tests and speed;
#    the grouped experts as two Triton kernels (moe_grouped_triton.py): tests, speed.
# 3: call 2's failures fixed (the capture read the step's batch; a test's expectation): the GPU
#    tests again, the timeline (also a new prefix's first hit), serve_bench.py --parts ttft peer.
# 4: the committed code: serve_bench.py --parts ttft (a second machine).
# 5: not run (no device time left): after merging the branch decode-down-sum, its GPU tests,
#    moe_decode_bench.py, the batch-1 census and serve_bench.py --parts decode.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 240 python3 benchmarks/warm_timeline.py > "$OUT/warm_timeline.log" 2>&1
  echo "== rc $?" >> "$OUT/warm_timeline.log"
  ;;
2)
  gpu_tests 200 tests/ops/test_moe.py tests/ops/test_mx_kernels.py tests/serve/test_engine_gpu.py \
    tests/ops/test_conv.py -k "group_pairs or combine or routed_experts or grouped or packed_experts \
    or logprobs_match or varlen"
  timeout -k 5 60 python3 benchmarks/conv_speed.py --varlen > "$OUT/conv_varlen.log" 2>&1
  echo "== rc $?" >> "$OUT/conv_varlen.log"
  timeout -k 5 90 python3 benchmarks/moe_route_bench.py > "$OUT/moe_route.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_route.log"
  timeout -k 5 120 python3 benchmarks/warm_timeline.py > "$OUT/warm_timeline.log" 2>&1
  echo "== rc $?" >> "$OUT/warm_timeline.log"
  timeout -k 5 180 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
3)  # after call 2: the capture's runs back on the pass's first batch, the measured block sizes
  gpu_tests 200 tests/ops/test_moe.py tests/ops/test_mx_kernels.py tests/serve/test_engine_gpu.py \
    tests/ops/test_conv.py -k "group_pairs or combine or routed_experts or grouped or packed_experts \
    or logprobs_match or varlen or cuda_graph_decode"
  timeout -k 5 100 python3 benchmarks/warm_timeline.py > "$OUT/warm_timeline.log" 2>&1
  echo "== rc $?" >> "$OUT/warm_timeline.log"
  timeout -k 5 240 python3 benchmarks/serve_bench.py --parts ttft peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
4)  # the committed code again on another machine: time to first token (the device time left
    # allowed no more)
  timeout -k 5 120 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
5)  # with the branch decode-down-sum merged (the routed experts' down GEMV and slot sum in one
    # kernel): its GPU tests, the decode GEMVs against the floor, the batch-1 census, decode
  gpu_tests 150 tests/ops/test_moe.py -k "gemv or routed_experts or triton_reads"
  timeout -k 5 90 python3 benchmarks/moe_decode_bench.py --presets small --tokens 1 8 32 128 > "$OUT/moe_decode.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_decode.log"
  timeout -k 5 90 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  timeout -k 5 150 python3 benchmarks/serve_bench.py --parts decode > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
*) echo "phase 1 to 5" >&2; exit 2 ;;
esac
summary
