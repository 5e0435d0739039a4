#!/usr/bin/env bash
# One call on `nvidia-h200-x2` that measures what issues 2-4 need from the device:
#   run(command="bash benchmarks/device_x2.sh", kind="nvidia-h200-x2", carry=[".whl", ".triton-cache"], timeout_s=590)
# GPU 0: KDA kernels, GPU tests, whole-model forward+backward. GPU 1 (at the same time): training
# throughput vs transformers, a 1-GPU `small` run. Then both GPUs: MoonEP vs EP without
# replication, a 2-GPU FSDP `small` run. Every log goes to $OUT as it is written; Triton's
# autotuning results (*.autotune.json, small) are tarred into $OUT every 20 s, so a later call
# that carries them in .triton-cache skips the minutes of autotuning.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache \
  OPENK3_CACHE=/tmp/openk3-cache NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$TRITON_CACHE_DIR"
save_autotune() { (cd "$TRITON_CACHE_DIR/.." && find .triton-cache -name '*.autotune.json' \
  | tar czf "$OUT/autotune.tgz.tmp" -T - && mv "$OUT/autotune.tgz.tmp" "$OUT/autotune.tgz") 2>/dev/null; }
( while sleep 20; do save_autotune; done ) & saver=$!
trap 'kill $saver 2>/dev/null; save_autotune' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

(
  export CUDA_VISIBLE_DEVICES=0
  timeout 200 python3 benchmarks/kda_bench.py > "$OUT/kda.log" 2>&1
  timeout 100 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf -x > "$OUT/gpu_tests.log" 2>&1
  timeout 60 python3 benchmarks/model_bench.py --preset small --batch 1 --seq 4096 > "$OUT/model.log" 2>&1
) & gpu0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 5 > "$OUT/train.log" 2>&1
  timeout 130 python3 -m openk3 train --preset small --out /tmp/runs/small1 --max-steps 40 --warmup-steps 5 \
    --log-interval 5 --eval-interval 20 --ckpt-interval 1000 --num-samples 1 --sample-tokens 32 \
    > "$OUT/small1.log" 2>&1
  cp /tmp/runs/small1/metrics.jsonl "$OUT/small1_metrics.jsonl"
) & gpu1=$!
wait $gpu0 $gpu1
timeout 60 torchrun --nproc-per-node 2 -m benchmarks.moonep_ep > "$OUT/moonep_ep.log" 2>&1
timeout 120 torchrun --nproc-per-node 2 -m openk3 train --preset small --out /tmp/runs/small2 --max-steps 30 \
  --warmup-steps 5 --log-interval 5 --eval-interval 15 --ckpt-interval 1000 --num-samples 1 --sample-tokens 32 \
  > "$OUT/small2.log" 2>&1
cp /tmp/runs/small2/metrics.jsonl "$OUT/small2_metrics.jsonl"
tail -3 "$OUT"/*.log
