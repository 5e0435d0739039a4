#!/usr/bin/env bash
# The twenty-second session's device calls:
#   run(command="bash benchmarks/device_s30.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the host-side cuts (prompt ids validated into an int64 array, uploaded from it; prefix-cache
#    keys and checks as bytes; one FlashAttention-2 call for a chunk whose split does not pay):
#    the attention's and engine's GPU tests, the attention by kernel, serve_bench.py --parts
#    ttft decode peer.
# 2: the same after uploads went through a ring of pinned host memory and one GEMM wrote the
#    prefill's keys and values; 3: the ring's copy as one memmove; 4: the convolution writing q, k
#    and v apart (each phase's GPU tests, then serve_bench.py).
# 5: (not run: no machine) on the branch merge-kernel, the Triton merge of the attention parts'
#    GPU tests, then serve_bench.py --parts ttft peer and --parts server.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 150 tests/ops/test_varlen_attention.py tests/serve/test_long_context.py \
    tests/serve/test_engine_gpu.py -k "varlen or parts or long_prefix or logprobs_match"
  timeout -k 10 60 python3 benchmarks/mla_prefill_attention.py > "$OUT/attention.log" 2>&1
  echo "== rc $?" >> "$OUT/attention.log"
  timeout -k 10 300 python3 benchmarks/serve_bench.py --parts ttft decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)  # phase 1 after a ring of pinned host memory replaced pinning per upload, and one GEMM writes
    # the prefill's keys and values (prefix_kv_weight)
  gpu_tests 150 tests/ops/test_varlen_attention.py tests/serve/test_long_context.py \
    tests/serve/test_engine_gpu.py tests/serve/test_model_runner.py \
    -k "varlen or parts or long_prefix or logprobs_match or staging"
  timeout -k 10 300 python3 benchmarks/serve_bench.py --parts ttft decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
3)  # the staging ring's copy as one memmove (Tensor.copy_ into pinned memory took ms): its GPU
    # test, then the prefill measurements
  gpu_tests 60 tests/serve/test_model_runner.py -k staging
  timeout -k 10 240 python3 benchmarks/serve_bench.py --parts ttft peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
4)  # the convolution writes q, k and v apart (no copies in fla's KDA): its GPU tests, the
    # engine's, then the serving measurement
  gpu_tests 200 tests/ops/test_conv.py tests/serve/test_engine_gpu.py tests/serve/test_long_context.py \
    tests/serve/test_model_runner.py tests/ops/test_varlen_attention.py \
    -k "varlen or logprobs_match or long_prefix or staging or parts"
  timeout -k 10 300 python3 benchmarks/serve_bench.py --parts ttft decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
5)  # (on the branch merge-kernel) the parts merged by one Triton kernel: the attention's GPU tests, then the prefill and server
    # measurements in what the session's device time leaves
  gpu_tests 60 tests/ops/test_varlen_attention.py -k "varlen or parts"
  timeout -k 5 130 python3 benchmarks/serve_bench.py --parts ttft peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 5 60 python3 benchmarks/serve_bench.py --parts server > "$OUT/server.log" 2>&1
  echo "== rc $?" >> "$OUT/server.log"
  ;;
*) echo "phase 1 to 5" >&2; exit 2 ;;
esac
