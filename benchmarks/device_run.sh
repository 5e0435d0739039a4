#!/usr/bin/env bash
# Everything openk3 measures on one H200, in order of importance, in one device call:
#   run(command="bash benchmarks/device_run.sh", carry=[".whl", ".triton-cache"], timeout_s=590)
# after `pip download` of fla-core 0.6.0 into .whl (see the device README). Triton's autotuning
# results are kept in .triton-cache and returned as $OUT/triton-cache.tgz: unpack it into
# .triton-cache here and carry it next time, and fla's kernels skip their minutes of autotuning.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$TRITON_CACHE_DIR"
save_cache() { tar czf "$OUT/triton-cache.tgz" .triton-cache 2>/dev/null; }
trap save_cache EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 benchmarks/kda_bench.py 2>&1 | tee "$OUT/kda.log"
save_cache
timeout 80 python3 benchmarks/model_bench.py --preset small --batch 1 --seq 4096 2>&1 | tee "$OUT/model.log"
save_cache
timeout 100 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests.log"
timeout 90 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 5 2>&1 | tee "$OUT/train.log"
save_cache
# issue 3's 1-GPU bf16 run of the small preset through the real CLI (embedded corpus)
timeout 100 python3 -m openk3 train --preset small --out /tmp/runs/small1 --max-steps 40 --log-interval 5 \
  --eval-interval 20 --ckpt-interval 1000 --num-samples 1 --sample-tokens 32 2>&1 | tail -40 | tee "$OUT/small1.log"
cp /tmp/runs/small1/metrics.jsonl "$OUT/small1_metrics.jsonl" 2>/dev/null
