#!/usr/bin/env bash
# The next session's device calls (written in the eighteenth):
#   run(command="bash benchmarks/device_s26.sh N", kind=KIND, carry=[".whl", ".triton-cache"], timeout_s=595)
# 1 (nvidia-h200): the GPU tests the eighteenth session's changes reach and did not run
#    (combine_pairs in the routed and packed experts: tests/ops/test_moe.py, tests/model/test_gpu.py,
#    tests/checkpoint/test_packed_load.py; sealed bank entries in recomputed layers:
#    test_compile.py's compiled-step tests).
# 2 (nvidia-h200-x2): P7's two-GPU targets (device_s18.sh 4).
# 3 (nvidia-h200): P8's decode runs and the router's three logits paths (device_s24.sh 3).
# 4 (nvidia-h200): `small`'s step against the peer with its census.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  gpu_tests 300 tests/ops/test_moe.py tests/model/test_gpu.py tests/checkpoint/test_packed_load.py
  gpu_tests 250 tests/parallel/test_compile.py -k compiled_step
  ;;
2) bash benchmarks/device_s18.sh 4 ;;
3) bash benchmarks/device_s24.sh 3 ;;
4) throughput_and_census ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
