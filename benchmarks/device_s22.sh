#!/usr/bin/env bash
# The next session's device calls (written in the sixteenth):
#   run(command="bash benchmarks/device_s22.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# .whl and .warm as device_common.sh says. The machine is released 30 s after a call: call again
# at once to keep it warm.
# 1 (nvidia-h200): P7 as committed: Newton-Schulz's per-matrix factors by the vectorised Triton
#    pass (`scale_matrices_`, never run on a GPU; torch's broadcast multiplies took 3.0 ms of the
#    last measured step, 176.7 ms): its GPU test and the optimiser's (bf16 Newton-Schulz against
#    fp64, new), the norm and router tests as the review left them (explicit backends, the
#    dispatch checked, fp16/bf16/fp32 only), beside a 200-step curve, then
#    the step against the peer with its profile (expected ~174.5 ms, 19.4% MFU) and the census.
# 2 (nvidia-h200): P8's decode step against the peer and its census (not run since the eleventh
#    session; the norms outside compiled regions are openk3's Triton kernels now).
# 3 (nvidia-h200): tests/parallel/test_compile.py alone (it stopped at 200-330 s beside other work
#    in four sessions).
# 4 (nvidia-h200-x2): P7's two-GPU targets (device_s18.sh 4).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  curve_beside_tests 230 220 tests/ops/test_muon.py tests/train/test_optim.py tests/train/test_graphed.py \
    tests/ops/test_norm.py tests/ops/test_router.py
  throughput_and_census
  ;;
2) bash benchmarks/device_s21.sh 2 ;;  # nested: shares this call's setup and saver
3) gpu_tests 500 tests/parallel/test_compile.py ;;
4) bash benchmarks/device_s18.sh 4 ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
