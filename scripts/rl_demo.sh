#!/usr/bin/env bash
# The CPU RL demo (docs/posttraining.md): pre-train the debug model briefly on arithmetic text
# written by the task itself ("3+5=8" lines), then RL it on the arithmetic task with rollouts
# from the serving engine; prints reward and accuracy per step, writes RUN/plots. A few minutes.
#   OUT_DIR=runs/rl-demo PRETRAIN_STEPS=150 RL_STEPS=40 bash scripts/rl_demo.sh [extra openk3 rl flags]
# A run directory already holding a pre-trained model is reused (PRETRAINED=DIR to give one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT_DIR:-runs/rl-demo}
PRETRAINED=${PRETRAINED:-$OUT/pretrain}
mkdir -p "$OUT"
if [ ! -d "$PRETRAINED/export" ]; then
  python - "$OUT/arithmetic.jsonl" <<'PY'
import json, random, sys
from openk3.posttrain.tasks import get_task

task, rng = get_task("arithmetic"), random.Random(0)
with open(sys.argv[1], "w") as fh:
    for _ in range(4000):  # documents of 16 solved problems each
        lines = [(p := task.sample(rng)).prompt + p.answer for _ in range(16)]
        fh.write(json.dumps({"text": "\n".join(lines) + "\n"}) + "\n")
PY
  openk3 train --preset debug --data "$OUT/arithmetic.jsonl" --vocab-size 512 --seq-len 128 \
    --out "$PRETRAINED" --max-steps "${PRETRAIN_STEPS:-150}" --num-samples 0 --device cpu
fi
rm -rf "$OUT/rl"
openk3 rl --checkpoint "$PRETRAINED" --task arithmetic --out "$OUT/rl" --max-steps "${RL_STEPS:-40}" \
  --group-size 8 --max-new-tokens 6 --max-model-len 32 --lr 3e-4 --device cpu "$@"
