#!/usr/bin/env bash
# Issue P9 on the device, in one call on nvidia-h200-x2 (the trained target cannot outlive a call):
#   run(command="bash benchmarks/device_p9.sh", kind="nvidia-h200-x2",
#       carry=[".whl", ".triton-cache"], timeout_s=598)
# GPU 0 trains `small` with one MTP layer on the embedded corpus, then its EAGLE-3 draft with the
# LK loss; GPU 1 meanwhile runs the GPU tests of QAT, post-training and vision and the rollout
# benchmark (P10, P12, P13), then the draft with the KL loss (same budget, same init: the MTP layer). Each GPU then
# measures its draft in the engine (benchmarks/spec_bench.py).
# Results in docs/benchmarks.md.
source "$(dirname "$0")/device_common.sh"
rm -rf /tmp/target.done /tmp/runs/target /tmp/drafts
draft() {  # draft LOSS: `openk3 train-draft` of the trained target, from its MTP layer
  timeout -k 5 110 python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out "/tmp/drafts/$1" \
    --loss "$1" --init mtp --steps 150 --batch-size 8 --seq-len 512 --log-interval 10 --save-interval 50 > "$OUT/draft_$1.log" 2>&1
  echo "== rc $?" >> "$OUT/draft_$1.log"; cp "/tmp/drafts/$1/metrics.jsonl" "$OUT/draft_$1.metrics.jsonl" 2>/dev/null
}
spec() {  # spec LOSS SECONDS: the draft in the engine against plain decoding, same run
  timeout -k 5 "$2" python3 benchmarks/spec_bench.py --checkpoint /tmp/runs/target --drafts "/tmp/drafts/$1" \
    --batch 1 8 --K 3 7 --temperatures 0 1 --num-prompts 8 --max-tokens 128 --json "$OUT/spec_$1.json" \
    > "$OUT/spec_$1.log" 2>&1; echo "== rc $?" >> "$OUT/spec_$1.log"
}
( export CUDA_VISIBLE_DEVICES=0
  train_run 270 target 1 --preset small --mtp-layers 1 --max-steps 150 --warmup-steps 15 --log-interval 10 \
    --no-compile
  touch /tmp/target.done
  draft lk
  spec lk 150 ) & gpu0=$!
( export CUDA_VISIBLE_DEVICES=1
  gpu_tests 70 -x tests/train/test_qat.py
  gpu_tests 80 tests/posttrain tests/serve/test_vision_serving_gpu.py tests/vision/test_gpu.py
  timeout 90 python3 benchmarks/rollout_bench.py --preset small --device cuda --lengths light \
    --prompts-per-step 32 --group-size 8 --max-new-tokens 512 --steps 3 > "$OUT/rollout.log" 2>&1
  while [ ! -e /tmp/target.done ]; do sleep 2; done
  draft kl
  spec kl 150 ) & gpu1=$!
wait $gpu0 $gpu1
summary
