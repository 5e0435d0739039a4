#!/usr/bin/env bash
# The twentieth session's device calls:
#   run(command="bash benchmarks/device_s28.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the graphed and compiled-step tests after the combine_pairs fix (device_s27.sh 5), then P8
#    as committed: cold and warm time to first token with both requests' profiles, the decode
#    steps, the Kimi Linear peer (first serving measurement since the leak fix).
# 2: the experts' sum in one kernel (combine_pairs_triton), the prefill's convolution
#    (conv_varlen_*), cuDNN's attention for cold batches and the prefill passes as piecewise CUDA
#    graphs: their GPU tests, then time to first token, decode runs and the peer; the MLA prefill
#    attention by kernel (mla_prefill_attention.py) and where a prefill step's host time goes
#    now (prefill_host.py). Then (the machine still warm) serve_bench.py --parts ttft decode peer
#    again with cuDNN's attention off.
# 3: tests/model/test_gpu.py, the rest of test_moe.py, test_varlen_attention.py.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 100 tests/train/test_graphed.py -k graphed_steps_match
  gpu_tests 80 tests/parallel/test_compile.py -k compiled_step
  timeout -k 10 380 python3 benchmarks/serve_bench.py --parts ttft decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)
  gpu_tests 140 tests/ops/test_moe.py tests/ops/test_conv.py tests/ops/test_varlen_attention.py \
    tests/serve/test_engine_gpu.py -k "combine or varlen_triton or triton_matches or cudnn or logprobs_match"
  timeout -k 10 230 python3 benchmarks/serve_bench.py --parts ttft decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 10 40 python3 benchmarks/mla_prefill_attention.py > "$OUT/attention.log" 2>&1
  echo "== rc $?" >> "$OUT/attention.log"
  timeout -k 10 90 python3 benchmarks/prefill_host.py > "$OUT/prefill_host.log" 2>&1
  echo "== rc $?" >> "$OUT/prefill_host.log"
  ;;
3)  # whole models on the fast path (the generate path's convolution with a state is openk3's now)
  gpu_tests 120 tests/model/test_gpu.py tests/ops/test_moe.py tests/ops/test_varlen_attention.py
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
