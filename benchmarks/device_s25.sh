#!/usr/bin/env bash
# The eighteenth session's device calls:
#   run(command="bash benchmarks/device_s25.sh N", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: sealed AttnRes bank entries (their reads accumulate the entry's gradient in openk3's backward
#    kernel, openk3/ops/attnres.py): the read's kernels against fla's backward and autograd's adds
#    (attnres_bench.py); the AttnRes GPU tests, the graphed-vs-eager test and the bounded-graphs
#    test beside `small`'s 200-step loss curve; `small`'s step against the peer with its profile;
#    determinism.py ops (index_add_ of the routed experts' k rows).
# 2: the routed experts' sum without index_add_ (openk3.ops.moe.combine_pairs) and the bench
#    timing kernels (the calls alone are host-bound): attnres_bench.py, the GPU tests of the
#    experts, AttnRes and packed experts, `small`'s step against the peer, determinism.py model.
# 3: the sealed GPU test alone (its first criterion failed; phase 2's tests ran out of time), then
#    the experts' GPU tests.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 10 60 python3 benchmarks/attnres_bench.py > "$OUT/attnres.log" 2>&1
  curve_beside_tests 260 260 tests/ops/test_attnres.py tests/train/test_graphed.py \
    tests/parallel/test_compile.py -k "sealed or fast_path_matches or fused_output or graphed_steps_match or bounded"
  timeout -k 10 190 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  timeout -k 10 60 python3 benchmarks/determinism.py ops > "$OUT/determinism_ops.log" 2>&1
  ;;
2)
  timeout -k 10 60 python3 benchmarks/attnres_bench.py > "$OUT/attnres.log" 2>&1
  gpu_tests 150 tests/ops/test_attnres.py tests/ops/test_moe.py tests/model/test_gpu.py \
    tests/checkpoint/test_packed_load.py
  timeout -k 10 190 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  timeout -k 10 130 python3 benchmarks/determinism.py model auto > "$OUT/determinism_model.log" 2>&1
  ;;
3)  # the sealed GPU test alone (its criterion rewritten), then the experts' GPU tests
  GPU_LOG=sealed gpu_tests 100 tests/ops/test_attnres.py -s -k sealed
  gpu_tests 120 tests/ops/test_moe.py tests/model/test_gpu.py
  ;;
*) echo "phase 1 to 3" >&2; exit 2 ;;
esac
summary
