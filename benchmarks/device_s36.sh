#!/usr/bin/env bash
# The twenty-eighth session's device calls:
#   run(command="bash benchmarks/device_s36.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the server over the engine process with every token a chunk (serve_bench.py --parts server
#    now gives both engines VisibleTokenizer: before, ids above 255 decoded to nothing and a round
#    streamed ~23 chunks of its 8,192 tokens) and the time each request reached the engine; the
#    warm request's timeline (warm_timeline.py); the verify and EAGLE GPU tests, not run since the
#    GEMV's norm and residual folds.
# 2: the server again with when each request was made by its client and when the engine had it
#    (threads: the openai client a thread per stream; raw: plain HTTP, a client of little CPU);
#    the warm request's timeline with the caching allocator's device allocations and the garbage
#    collections counted per request (the first hit of a new prefix was 2.3 ms slower than the
#    same prefix again in call 1).
# 3: the warm/cold time to first token (serve_bench.py --parts ttft), then each GEMV fold apart
#    by the decode graph replay's GPU time (decode-split --split-variants folds), with the GEMV's
#    add fallback mended (the twenty-seventh session's A/B variants without the add fold ran the
#    attention's o_proj in cuBLAS).
# 4: one chunk's cache rows in three launches (ModelRunner._prefill_batch with the slot on the
#    host) and a copy-on-write block's rows in one call for all MLA layers: the warm/cold time
#    to first token again, the engine's log-prob and long-prefix GPU tests.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 240 python3 benchmarks/serve_bench.py --parts server --client-procs 8 \
    --server-engines process > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 5 100 python3 benchmarks/warm_timeline.py > "$OUT/warm_timeline.log" 2>&1
  echo "== rc $?" >> "$OUT/warm_timeline.log"
  gpu_tests 200 tests/serve/test_verify_gpu.py tests/serve/test_eagle_engine_gpu.py
  ;;
2)
  timeout -k 5 100 python3 benchmarks/warm_timeline.py > "$OUT/warm_timeline.log" 2>&1
  echo "== rc $?" >> "$OUT/warm_timeline.log"
  timeout -k 5 300 python3 benchmarks/serve_bench.py --parts server --client-procs 8 \
    --server-engines process --clients threads raw > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
3)
  timeout -k 5 170 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/ttft.log" 2>&1
  echo "== rc $?" >> "$OUT/ttft.log"
  timeout -k 5 280 python3 benchmarks/serve_bench.py --parts decode-split --split-variants folds \
    > "$OUT/split.log" 2>&1
  echo "== rc $?" >> "$OUT/split.log"
  ;;
4)
  timeout -k 5 120 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/ttft.log" 2>&1
  echo "== rc $?" >> "$OUT/ttft.log"
  gpu_tests 110 tests/serve/test_engine_gpu.py tests/serve/test_long_context.py -k "logprobs_match or long_prefix"
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
