#!/usr/bin/env bash
# The next one-GPU session's calls (written in the twelfth), issue P7 first:
#   run(command="bash benchmarks/device_s14.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache", ".before", ".warm"], timeout_s=595)
# (.warm: the last call's warm.tgz unpacked, benchmarks/device_common.sh; absent on the first call)
# .before holds the eleventh session's package: `git archive c412b69 openk3 | tar -x -C .before`.
# The machine is released 30 s after a call: make the next call at once, or pay its start again.
# 1: the graphed step's GPU test (graphed against eager steps; `small`'s widths, four layers),
#    then the graphed step profiled (where its 236 ms of GPU work go) and the eager step's
#    throughput in the same call.
# 2: three 200-step loss curves of `small` side by side on the GPU, to settle whether the graphed
#    run's +0.05 after step 100 (twelfth session, one pair of runs) is noise: the eleventh
#    session's package (eager, old Newton-Schulz), this package eager (--no-cuda-graph: the
#    baddbmm Newton-Schulz and capturable AdamW alone), and this package graphed (the default).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 200 python3 -m pytest -m gpu tests/train/test_graphed.py -x -q -s -p no:cacheprovider \
    -o faulthandler_timeout=190 > "$OUT/gpu_tests.log" 2>&1
  echo "== rc $?" >> "$OUT/gpu_tests.log"
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --no-peer \
    --profile > "$OUT/profile_graphed.log" 2>&1
  echo "== rc $?" >> "$OUT/profile_graphed.log"
  timeout -k 10 150 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --no-peer \
    --no-cuda-graph > "$OUT/eager.log" 2>&1
  echo "== rc $?" >> "$OUT/eager.log"
  ;;
2)
  curve() {  # curve NAME DIR FLAGS...: 200 steps of `small` from the package in DIR
    local name=$1 dir=$2; shift 2
    (cd "$dir" && OPENK3_CACHE=/tmp/cache-$name timeout -k 10 500 python3 -m openk3 train --preset small \
      --max-steps 200 --warmup-steps 20 --log-interval 5 --eval-interval 100 --ckpt-interval 100000 \
      --num-samples 0 --out "/tmp/runs/$name" "$@" > "$OUT/$name.log" 2>&1; echo "== rc $?" >> "$OUT/$name.log"
     cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl")
  }
  curve before .before & curve eager . --no-cuda-graph & curve graphed . &
  wait
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
