# Sourced by the device scripts: fla from the carried wheel, Triton's autotuning results (the
# committed benchmarks/autotune-h200.tgz when .triton-cache is empty), and a saver that tars the
# results every 20 s so a call cut short still returns them. Results are written under $OUT as
# the scripts see it (/tmp/res); what comes back is two files in the device's $OUT, results.tgz
# and autotune.tgz (a call returns at most 8 files), and at a clean exit warm.tgz: inductor's
# cache (compiled regions: 60-90 s of a fresh machine's first training step), if it packs into
# 15 MiB. Unpack it with `mkdir -p .warm && tar xzf warm.tgz -C .warm` and carry ".warm": the
# next call starts from it.
# .whl (git-ignored) holds what the device lacks, as Python 3.12 x86-64 wheels: fla-core 0.6.0
# and openk3's serving dependencies with theirs (fastapi, starlette, uvicorn, httptools, uvloop,
# pydantic, pydantic-core, anyio, rich, prometheus_client, ...). Made on a fresh checkout with
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp #     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 #     -d .whl fla-core==0.6.0 fastapi uvicorn httptools uvloop rich prometheus_client
# (11 MiB; with .triton-cache and a ~47 MiB .warm the carried paths stay under the 64 MiB limit).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nested=${OPENK3_DEVICE_COMMON:-}
if [ -z "$nested" ]; then  # a runbook run by another one shares its setup and saver
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=$PWD/.triton-cache \
  OPENK3_CACHE=/tmp/openk3-cache NCCL_NVLS_ENABLE=0 OPENK3_DEVICE_COMMON=1
BACK=${OUT:-/tmp/out}; export OUT=/tmp/res; mkdir -p "$BACK" "$OUT" "$TRITON_CACHE_DIR"
[ -n "$(ls -A "$TRITON_CACHE_DIR")" ] || tar xzf benchmarks/autotune-h200.tgz
[ -d .warm/inductor-cache ] && [ ! -e /tmp/inductor-cache ] && cp -r .warm/inductor-cache /tmp/inductor-cache
save_warm() {  # inductor's cache, when it fits what a call may return
  tar czf "$BACK/warm.tgz.tmp" -C /tmp inductor-cache 2>/dev/null || return
  if [ "$(stat -c %s "$BACK/warm.tgz.tmp")" -le $((15 * 1024 * 1024)) ]; then
    mv "$BACK/warm.tgz.tmp" "$BACK/warm.tgz"
  else
    rm -f "$BACK/warm.tgz.tmp"; echo "warm.tgz: inductor's cache is over 15 MiB packed, not returned"
  fi
}
save_autotune() { (find .triton-cache -name '*.autotune.json' | tar czf "$BACK/autotune.tgz.tmp" -T - \
  && mv "$BACK/autotune.tgz.tmp" "$BACK/autotune.tgz"; tar czf "$BACK/results.tgz.tmp" -C "$OUT" . \
  && mv "$BACK/results.tgz.tmp" "$BACK/results.tgz") 2>/dev/null; }
( while sleep 20; do save_autotune; done ) & saver=$!
disown $saver  # a script's bare `wait` must not wait for it (device_s13/s14/s15 phase 2 did, until the call's limit)
trap 'kill $saver 2>/dev/null; save_autotune; save_warm' EXIT
fi
summary() { [ -n "$nested" ] && return; for f in "$OUT"/*.log; do echo "== $f"; tail -n 6 "$f"; done; }
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
gpu_tests() { local limit=$1; shift; timeout "$limit" python3 -m pytest -m gpu "$@" -q -p no:cacheprovider \
  -rfE --tb=short >> "$OUT/${GPU_LOG:-gpu_tests}.log" 2>&1; echo "== $*: rc $?" >> "$OUT/${GPU_LOG:-gpu_tests}.log"; }
curve_beside_tests() {  # SECONDS (curve) SECONDS (tests) TESTS...: `small`'s 200-step loss curve
  # (docs/benchmarks.md, P7) beside the GPU tests of a change
  local curve=$1 tests=$2; shift 2
  (timeout -k 10 "$curve" python3 -m openk3 train --preset small --max-steps 200 --warmup-steps 20 \
    --log-interval 5 --eval-interval 100 --ckpt-interval 100000 --num-samples 0 --out /tmp/runs/curve \
    > "$OUT/curve.log" 2>&1; echo "== rc $?" >> "$OUT/curve.log"
   cp /tmp/runs/curve/metrics.jsonl "$OUT/curve.metrics.jsonl") &
  gpu_tests "$tests" "$@"
  wait
}
throughput_and_census() {  # `small`'s step against the peer with its profile, then the census
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  timeout -k 10 100 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --no-peer \
    --census > "$OUT/census.log" 2>&1
  echo "== rc $?" >> "$OUT/census.log"
}
train_run() {  # train_run SECONDS NAME NPROC EXTRA...: `openk3 train` from the current directory's
  local limit=$1 name=$2 n=$3; shift 3  # package (python -m puts the directory first on sys.path)
  timeout -k 10 "$limit" torchrun --nproc-per-node "$n" -m openk3 train --out "/tmp/runs/$name" \
    --eval-interval 100000 --ckpt-interval 100000 --num-samples 0 "$@" > "$OUT/$name.log" 2>&1
  echo "== rc $?" >> "$OUT/$name.log"
  cp "/tmp/runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
}
p9_target_and_draft() {  # [DRAFT_STEPS [DRAFT_SECONDS]]: P9's `small` target with one MTP layer (150
  # steps, /tmp/runs/target) and its LK draft from that layer (/tmp/drafts/lk; 120 steps in at
  # most 140 s by default): the recipe of the P9 tables
  local steps=${1:-120} limit=${2:-140}
  timeout -s INT -k 30 190 python3 -m openk3 train --preset small --mtp-layers 1 --max-steps 150 --warmup-steps 15 \
    --log-interval 10 --no-compile --eval-interval 100000 --ckpt-interval 100000 --num-samples 0 \
    --out /tmp/runs/target > "$OUT/target.log" 2>&1; echo "== rc $?" >> "$OUT/target.log"
  timeout -s INT -k 30 "$limit" python3 -m openk3 train-draft --checkpoint /tmp/runs/target --out /tmp/drafts/lk \
    --loss lk --init mtp --steps "$steps" --ttt-steps 7 --batch-size 8 --seq-len 512 --log-interval 10 \
    --save-interval 40 > "$OUT/draft_lk.log" 2>&1; echo "== rc $?" >> "$OUT/draft_lk.log"
}
