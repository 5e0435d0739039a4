#!/usr/bin/env bash
# The next session's device calls (written in the seventeenth):
#   run(command="bash benchmarks/device_s24.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1 (nvidia-h200): where fresh instances of one model part with the split router logits
#    (determinism.py model: a forward with autograd repeated on one instance, then every module's
#    output in call order on three fresh instances, naming the first that differs), then
#    tests/parallel/test_compile.py alone, which now logs dynamo's recompilation reasons (its
#    bounded-graphs test counted 20 frames after a second training shape, 18 allowed).
# 2 (nvidia-h200-x2): P7's two-GPU targets (device_s18.sh 4).
# 3 (nvidia-h200): P8's decode runs again, now with each prefill step's time
#    (serve_bench.py's prefill_steps_ms): the batch-128 run's steps other than decode took ~0.62 s
#    in the seventeenth session against ~0.39 s in the eleventh (16,384 prompt tokens); then the
#    router's logits by GEMV, fp32 GEMM and split bf16 GEMM from 1 to 8,192 tokens without autograd
#    (moe_decode_bench.py --router: whether serving's batches past 32 tokens should keep the fp32 GEMM).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  for b in auto torch; do
    timeout -k 10 150 python3 benchmarks/determinism.py model $b > "$OUT/determinism_$b.log" 2>&1 &
  done
  wait
  GPU_LOG=compile gpu_tests 400 tests/parallel/test_compile.py
  ;;
2) bash benchmarks/device_s18.sh 4 ;;
3)
  timeout -k 10 400 python3 benchmarks/serve_bench.py --parts decode > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 10 120 python3 benchmarks/moe_decode_bench.py --router --presets small \
    --tokens 1 8 32 33 64 128 512 2048 8192 > "$OUT/router.log" 2>&1
  echo "== rc $?" >> "$OUT/router.log"
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
