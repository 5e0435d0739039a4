#!/usr/bin/env bash
# The fourteenth session's one-GPU calls, issue P7 first:
#   run(command="bash benchmarks/device_s17.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# 1: the GPU tests of the graphed step and Muon (device_s16.sh 1 ran them without an inductor
#    cache, past its 150 s), the Quantile Balancing update's k-th value down the tokens against
#    along rows (benchmarks/qb_speed.py), then the graphed step against the transformers peer with
#    its profile and the census of one eager step (device_s16.sh 1's census failed on torch 2.11:
#    FunctionEvent has no linked_correlation_id there).
# 2: after Muon's elementwise passes as Triton kernels (openk3/ops/muon.py), norms returning the
#    autocast dtype and the embedding cast once into the AttnRes bank: a 200-step loss curve
#    (device_s15.sh 2's settings) beside the GPU tests of what changed, then the graphed step
#    against the peer with its profile and census.
# 3: (as first run: KDA's short convolutions as shifted multiply-adds in the compiled regions,
#    measured slower than fla's kernels and reverted, docs/benchmarks.md.) Now: Newton-Schulz's
#    a X + B X as one product (a I + B) X, and the Muon kernels' explicit fma: the GPU tests of
#    what changed beside another 200-step curve, then the graphed step against the peer.
# 4: P8 as device_s12.sh 1 left it: the decode steps against the peer and the censuses.
source "$(dirname "$0")/device_common.sh"
step_against_peer() {  # SECONDS FLAGS...: the graphed step of `small` against the transformers peer
  local limit=$1; shift
  timeout -k 10 "$limit" python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 "$@" \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
}
case "${1:?phase}" in
1)
  gpu_tests 220 tests/train/test_graphed.py tests/train/test_optim.py -s
  timeout -k 5 60 python3 benchmarks/qb_speed.py > "$OUT/qb_speed.log" 2>&1
  echo "== rc $?" >> "$OUT/qb_speed.log"
  step_against_peer 240 --profile --census
  ;;
2)
  curve_beside_tests 230 220 tests/ops/test_muon.py tests/ops/test_norm.py tests/train/test_optim.py \
    tests/train/test_graphed.py
  step_against_peer 240 --profile --census
  ;;
3)
  curve_beside_tests 220 200 tests/ops/test_muon.py tests/train/test_optim.py tests/train/test_graphed.py
  step_against_peer 150 --profile
  ;;
4)
  bash benchmarks/device_s12.sh 1  # nested: shares this call's setup and saver
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
