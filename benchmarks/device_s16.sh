#!/usr/bin/env bash
# The next one-GPU session's calls (written in the thirteenth), issue P7 first:
#   run(command="bash benchmarks/device_s16.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# (.warm: a call's warm.tgz unpacked, benchmarks/device_common.sh; without it the first training
# step pays 60-90 s of inductor compilation.)
# The machine is released 30 s after a call: make the next call at once, or pay its start again.
# 1: the GPU tests of the graphed step (the thirteenth session's last change, gradients written
#    by the first micro-batch's graph instead of zeroed and accumulated into, has not run on a
#    GPU) and of Muon's in-place update; then the thirteenth session's changes measured (Muon's
#    in-place update and fused AdamW passed their GPU tests in device_s15.sh 2): the graphed
#    step against the transformers peer in the same run with its profile, then the census of
#    one eager step (which module's forward or backward, or which optimiser, launches which
#    kernels: benchmarks/train_census.py), then the eager step's throughput.
# 2: P8 as device_s12.sh 1 left it: the decode steps against the peer and the censuses.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 150 python3 -m pytest -m gpu tests/train/test_graphed.py tests/train/test_optim.py -q -s \
    -p no:cacheprovider -rfE --tb=short > "$OUT/gpu_tests.log" 2>&1
  echo "== rc $?" >> "$OUT/gpu_tests.log"
  timeout -k 10 240 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    --census > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  timeout -k 10 120 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --no-peer \
    --no-cuda-graph > "$OUT/eager.log" 2>&1
  echo "== rc $?" >> "$OUT/eager.log"
  ;;
2)
  bash benchmarks/device_s12.sh 1  # nested: shares this call's setup and saver
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
