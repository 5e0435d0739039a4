#!/usr/bin/env bash
# The twenty-sixth session's device calls:
#   run(command="bash benchmarks/device_s34.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the decode step's independent parts as parallel graph branches (openk3/model/branch.py) and
#    its projections of up to 4 rows as Triton GEMVs (openk3/ops/gemv.py): their GPU tests, the
#    GEMV against cuBLAS per projection shape (gemv_bench.py --sweep), and the decode step with
#    each change off and on (serve_bench.py --parts decode-ab).
# 2: the GEMV's blocks from phase 1's sweep (two 1,024-wide rows a program, 2 warps): its tests,
#    gemv_bench.py at 1-8 rows with sweeps at 1, 4 and 8, the routed experts' GEMV rows per
#    program (moe_decode_bench.py --rows), decode-ab again.
# 3: GEMV blocks from phase 2's sweep (512-wide steps from 2 rows on, 2 warps), cuBLAS for
#    outputs over 2,048 wide from 3 rows on, the add's old value loaded first: the GPU tests of
#    the changed paths (engine, speculative verify and EAGLE graphs), decode-ab twice, decode
#    (the default settings at batch 1, 32, 128), the warm/cold time to first token.
# 4: the GEMV test's bound for cuBLAS where `linear` keeps it (mended), decode and the server over
#    the engine process (two rounds of eight client processes).
# 5 (not run: for the next session): the router's logits GEMV with fewer experts and wider steps
#    per program (moe_decode_bench.py --router --logits-blocks), the router being the MoE layer's
#    critical branch now.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 200 tests/ops/test_gemv.py tests/serve/test_engine_gpu.py
  timeout -k 5 150 python3 benchmarks/gemv_bench.py --sweep > "$OUT/gemv.log" 2>&1
  echo "== rc $?" >> "$OUT/gemv.log"
  timeout -k 5 200 python3 benchmarks/serve_bench.py --parts decode-ab > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)
  gpu_tests 100 tests/ops/test_gemv.py
  timeout -k 5 150 python3 benchmarks/gemv_bench.py --rows 1 2 4 8 --sweep 1 4 8 > "$OUT/gemv.log" 2>&1
  echo "== rc $?" >> "$OUT/gemv.log"
  timeout -k 5 60 python3 benchmarks/moe_decode_bench.py --presets small --tokens 1 4 8 --rows 2 4 8 \
    > "$OUT/moe_decode.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_decode.log"
  timeout -k 5 270 python3 benchmarks/serve_bench.py --parts decode-ab > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
3)
  gpu_tests 230 tests/ops/test_gemv.py tests/serve/test_engine_gpu.py tests/serve/test_verify_gpu.py \
    tests/serve/test_eagle_engine_gpu.py
  timeout -k 5 300 python3 benchmarks/serve_bench.py --parts decode-ab decode ttft > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
4)
  gpu_tests 100 tests/ops/test_gemv.py
  timeout -k 5 300 python3 benchmarks/serve_bench.py --parts decode server --client-procs 8 8 \
    --server-engines process > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
5)
  timeout -k 5 90 python3 benchmarks/moe_decode_bench.py --router --presets small k3 --tokens 1 4 32 \
    --logits-blocks 1x1024 2x512 2x1024 4x512 8x256 > "$OUT/router.log" 2>&1
  echo "== rc $?" >> "$OUT/router.log"
  ;;
*) echo "phase 1 to 5" >&2; exit 2 ;;
esac
summary
