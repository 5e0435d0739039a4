#!/usr/bin/env bash
# Issue P9 on the device, in one call on nvidia-h200-x2 (the trained target cannot outlive a call):
#   run(command="bash benchmarks/device_p9.sh", kind="nvidia-h200-x2",
#       carry=[".whl", ".triton-cache"], timeout_s=598)
# GPU 0 trains `small` with one MTP layer on the embedded corpus, then its EAGLE-3 draft with the
# LK loss; GPU 1 runs the GPU tests of the speculative paths and the OpenAI-server benchmark
# meanwhile, then the draft with the KL loss (same budget, same init: the MTP layer). Each GPU then
# measures its draft in the engine (benchmarks/spec_bench.py). GPU 1 also runs the packed MXFP4
# kernels' tests (P10). Results in docs/benchmarks.md.
source "$(dirname "$0")/device_common.sh"
draft() {  # draft LOSS: `openk3 train-draft` of the trained target, from its MTP layer
  timeout -k 5 100 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out "/tmp/drafts/$1" \
    --loss "$1" --init mtp --steps 300 --batch-size 8 --seq-len 512 --log-interval 25 > "$OUT/draft_$1.log" 2>&1
  echo "== rc $?" >> "$OUT/draft_$1.log"; cp "/tmp/drafts/$1/metrics.jsonl" "$OUT/draft_$1.metrics.jsonl" 2>/dev/null
}
spec() {  # spec LOSS SECONDS: the draft in the engine against plain decoding, same run
  timeout -k 5 "$2" python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts "/tmp/drafts/$1" \
    --batch 1 8 --K 3 7 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --json "$OUT/spec_$1.json" \
    > "$OUT/spec_$1.log" 2>&1; echo "== rc $?" >> "$OUT/spec_$1.log"
}
( export CUDA_VISIBLE_DEVICES=0
  train_run 250 target 1 --preset small --mtp-layers 1 --max-steps 200 --warmup-steps 20 --log-interval 10 \
    --no-compile
  touch /tmp/target.done
  draft lk
  spec lk 170 ) & gpu0=$!
( export CUDA_VISIBLE_DEVICES=1
  gpu_tests 100 tests/serve/test_eagle_engine_gpu.py tests/serve/test_engine_gpu.py tests/ops/test_kda_rollback.py
  gpu_tests 60 tests/ops/test_mx_kernels.py
  timeout 80 python3 benchmarks/serve_bench.py --parts server > "$OUT/server.log" 2>&1
  while [ ! -e /tmp/target.done ]; do sleep 2; done
  draft kl
  spec kl 170 ) & gpu1=$!
wait $gpu0 $gpu1
summary
