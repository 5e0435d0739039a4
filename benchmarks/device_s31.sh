#!/usr/bin/env bash
# The twenty-third session's device calls:
#   run(command="bash benchmarks/device_s31.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the Triton merge of the attention parts (the branch merge-kernel, merged): its GPU tests,
#    then serve_bench.py --parts ttft peer, the batch-1 decode census and --parts server.
# 2: benchmarks/graph_launch.py (graph launches' host time and the GPU's wait for them), the
#    server again (1.99x the engine in call 1, 1.16x in the twenty-first session).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 90 tests/ops/test_varlen_attention.py tests/serve/test_long_context.py -k "varlen or parts or long_prefix"
  timeout -k 5 150 python3 benchmarks/serve_bench.py --parts ttft peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 5 90 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
  timeout -k 5 80 python3 benchmarks/serve_bench.py --parts server > "$OUT/server.log" 2>&1
  echo "== rc $?" >> "$OUT/server.log"
  ;;
2)  # how long a graph's launch holds the host and the GPU (synthetic chains, the decode step,
    # a prefill pass's pieces)
  timeout -k 5 200 python3 benchmarks/graph_launch.py > "$OUT/graph_launch.log" 2>&1
  echo "== rc $?" >> "$OUT/graph_launch.log"
  timeout -k 5 80 python3 benchmarks/serve_bench.py --parts server > "$OUT/server.log" 2>&1
  echo "== rc $?" >> "$OUT/server.log"
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
