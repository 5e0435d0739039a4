#!/usr/bin/env bash
# The next one-GPU session's first calls (written in the tenth): the P8 data the next decode-step
# work needs, in two calls of up to ~7 and ~5 minutes (either may run alone):
#   run(command="bash benchmarks/device_s11.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1: the GPU tests of the tenth session's decode-step kernels (in-place KDA: conv kernel, fla's
#    continuous-batching mode; the router kernel; the engine and verify passes); then which module
#    launches which kernels in one eager decode step of `small` at batch 1 and 32
#    (decode_census.py: the graph replays the same kernels).
# 2: the server against the engine with the `openai` client in one process and in eight (the
#    ninth session's 1.66x was one process's GIL: docs/serving.md); the decode steps of `small`
#    at batch 1, 32, 128 against the transformers peer (serve_bench.py --parts server decode peer).
# 3: (written in the eleventh session, after 1 and 2) the GPU tests of its decode-step changes:
#    the router's logits GEMV, the MoE down kernel that sums the slots, the residual added in
#    the output GEMMs (whole bf16 models against fp32: test_gpu.py, test_fuse.py); the census again.
# 4: the decode steps against the peer again (serve_bench.py --parts decode peer).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 200 tests/ops/test_conv.py tests/ops/test_kda_pooled.py tests/ops/test_router.py tests/ops/test_attnres.py tests/serve/test_engine_gpu.py \
    tests/serve/test_verify_gpu.py tests/model/test_fuse.py
  for b in 1 32; do
    timeout -k 10 120 python3 benchmarks/decode_census.py --preset small --batch $b > "$OUT/census_b$b.log" 2>&1
    echo "== rc $?" >> "$OUT/census_b$b.log"
    [ -f "$OUT/decode_census.json" ] && mv "$OUT/decode_census.json" "$OUT/decode_census_b$b.json"
  done
  ;;
2)
  timeout -k 10 540 python3 benchmarks/serve_bench.py --parts server decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
3)
  gpu_tests 330 tests/ops/test_router.py tests/ops/test_moe.py tests/model/test_fuse.py tests/model/test_gpu.py \
    tests/serve/test_engine_gpu.py
  for b in 1 32; do
    timeout -k 10 90 python3 benchmarks/decode_census.py --preset small --batch $b > "$OUT/census_b$b.log" 2>&1
    echo "== rc $?" >> "$OUT/census_b$b.log"
    [ -f "$OUT/decode_census.json" ] && mv "$OUT/decode_census.json" "$OUT/decode_census_b$b.json"
  done
  ;;
4)
  timeout -k 10 400 python3 benchmarks/serve_bench.py --parts decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
*) echo "phase 1, 2, 3 or 4" >&2; exit 2 ;;
esac
summary
