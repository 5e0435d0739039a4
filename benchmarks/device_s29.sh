#!/usr/bin/env bash
# The twenty-first session's device calls:
#   run(command="bash benchmarks/device_s29.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: one sequence's prefill attention in parts (cuDNN or FlashAttention-2 pieces over the prefix, cuDNN's
#    causal square, merged by log-sum-exp): its GPU tests and the engine's, the attention by
#    kernel (mla_prefill_attention.py), then serve_bench.py --parts ttft decode peer server
#    (every prefill pass graphed; the profiles with the GPU's idle gaps; SERVE_EXTRA= leaves out
#    the server).
# 2: serve_bench.py --parts ttft peer, the prefill convolution by block size (conv_speed.py
#    --varlen), then the GPU tests still without a result that fit: the whole-model tests, the
#    graphed training step's. (As run, it began with a bench of the host upload three ways,
#    since removed with the change it measured: docs/benchmarks.md, twenty-first session.)
# 3: (run first in the twenty-second session) the committed code: the attention's and engine's GPU tests, the attention by
#    kernel, serve_bench.py --parts ttft decode peer.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 150 tests/ops/test_varlen_attention.py tests/serve/test_long_context.py \
    tests/serve/test_engine_gpu.py tests/ops/test_conv.py -k "varlen or parts or long_prefix or logprobs_match"
  timeout -k 10 60 python3 benchmarks/mla_prefill_attention.py > "$OUT/attention.log" 2>&1
  echo "== rc $?" >> "$OUT/attention.log"
  timeout -k 10 300 python3 benchmarks/serve_bench.py --parts ttft decode peer ${SERVE_EXTRA-server} > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)  # the measurement, the prefill convolution by block size, then as many of the GPU tests
    # still without a result as the call's time allows
  timeout -k 10 200 python3 benchmarks/serve_bench.py --parts ttft peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 10 40 python3 benchmarks/conv_speed.py --varlen > "$OUT/conv.log" 2>&1
  echo "== rc $?" >> "$OUT/conv.log"
  gpu_tests 150 tests/model/test_gpu.py
  gpu_tests 100 tests/train/test_graphed.py -k graphed_steps_match
  ;;
3)  # for the next session, the code as committed after call 5 (not yet run): the attention's
    # GPU tests (the cuDNN tail, the mixed route), the engine's, the attention by kernel, then
    # the serving measurement
  gpu_tests 150 tests/ops/test_varlen_attention.py tests/serve/test_long_context.py \
    tests/serve/test_engine_gpu.py tests/ops/test_moe.py -k "varlen or parts or long_prefix or logprobs_match or sort_pairs"
  timeout -k 10 60 python3 benchmarks/mla_prefill_attention.py > "$OUT/attention.log" 2>&1
  echo "== rc $?" >> "$OUT/attention.log"
  timeout -k 10 300 python3 benchmarks/serve_bench.py --parts ttft decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
