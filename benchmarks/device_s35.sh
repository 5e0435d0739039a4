#!/usr/bin/env bash
# The twenty-seventh session's device calls:
#   run(command="bash benchmarks/device_s35.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the norms folded into the decode GEMVs (openk3.ops.gemv.norm_linear: the latent MoE's RMSNorm
#    before its up projection, KDA's gated output norm before o_proj): the GEMV and engine GPU
#    tests, the folded norms against norm + GEMV (gemv_bench.py --norms), the decode step with the
#    fold off and on (serve_bench.py --parts decode-ab).
# 2: the residual add after the attention's o_proj folded into its GEMV too (linear(x, w, add)),
#    the norm fold at most 2,048 of rows x K: the GEMV and engine GPU tests; the decode step split
#    into its graph replay's GPU time and the host time around it, each fold on and off
#    (serve_bench.py --parts decode-split); the warm request's timeline without a profiler
#    (warm_timeline.py: the prompt's ids validated by struct now); the warm/cold time to first token.
# 3: overlapped decoding (EngineConfig.overlap_decode: the next decode step launched before this
#    step's tokens reach the host): the engine's GPU tests; the decode step's period against its
#    replay's GPU time with the session's changes on and off (serve_bench.py --parts
#    decode-split); the decode part at batch 1 / 32 / 128 (no synchronisation per step now).
# 4: the overlapped decoding GPU test (rows ending together: bit-equal to plain stepping;
#    ragged: teacher-forced), and the server over the engine process with overlapped decoding.
# (Still not run: device_s34.sh 5, the router's logits GEMV at other blocks.)
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 220 tests/ops/test_gemv.py tests/serve/test_engine_gpu.py
  timeout -k 5 60 python3 benchmarks/gemv_bench.py --norms --rows 1 2 4 > "$OUT/gemv.log" 2>&1
  echo "== rc $?" >> "$OUT/gemv.log"
  timeout -k 5 280 python3 benchmarks/serve_bench.py --parts decode-ab > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)
  gpu_tests 170 tests/ops/test_gemv.py tests/serve/test_engine_gpu.py
  timeout -k 5 110 python3 benchmarks/serve_bench.py --parts decode-split > "$OUT/split.log" 2>&1
  echo "== rc $?" >> "$OUT/split.log"
  timeout -k 5 110 python3 benchmarks/warm_timeline.py > "$OUT/warm_timeline.log" 2>&1
  echo "== rc $?" >> "$OUT/warm_timeline.log"
  timeout -k 5 170 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
3)
  gpu_tests 200 tests/serve/test_engine_gpu.py
  timeout -k 5 150 python3 benchmarks/serve_bench.py --parts decode-split > "$OUT/split.log" 2>&1
  echo "== rc $?" >> "$OUT/split.log"
  timeout -k 5 180 python3 benchmarks/serve_bench.py --parts decode > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
4)
  gpu_tests 110 tests/serve/test_engine_gpu.py -k overlapped
  timeout -k 5 240 python3 benchmarks/serve_bench.py --parts server --client-procs 8 \
    --server-engines process > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
