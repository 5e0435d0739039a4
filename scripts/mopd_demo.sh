#!/usr/bin/env bash
# The CPU MOPD demo (docs/posttraining.md, "MOPD demo (CPU)"): multi-teacher on-policy
# distillation end to end on the debug model: 15 minutes on two busy shared cores with
# OMP_NUM_THREADS=1 (without it, a pre-training step took over 30 s there instead of 2.6 s).
#   1. pre-train a base on solved text of two domains, written by the tasks themselves:
#      arithmetic ("3+5=8", domain math) and sorting ("sort 3 1 2:1 2 3", domain text);
#   2. RL teacher A on arithmetic and teacher B on sorting, each from the base;
#   3. distill a student from the base with both teachers (math:*=A, text:*=B; the task reward
#      is off, the teachers' per-token reward alone trains it);
#   4. `openk3 eval` base, teachers and student on both tasks (greedy, held-out problems) and
#      print base / A / B / student accuracy per task and student / teacher.
# Why these two: each is a short, regular mapping of a few tokens that the 2M-parameter debug
# model learns to a middling accuracy from a few hundred steps of solved text, so RL has room to
# improve it and the teachers differ (each is a specialist); they are also two domains, which
# MOPD's teachers are keyed by (string_edit is "text" too, python needs a far larger model).
#   OUT_DIR=runs/mopd-demo PRETRAIN_STEPS=120 RL_STEPS=30 DISTILL_STEPS=40 EVAL_PROBLEMS=200 \
#     bash scripts/mopd_demo.sh
# A run directory already holding the pre-trained base is reused (PRETRAINED=DIR to give one).
# DISTILL_ARGS: more flags for the distillation (e.g. "--reward-weight 1": the task reward beside
# the teachers').
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
OUT=${OUT_DIR:-runs/mopd-demo}
BASE=${PRETRAINED:-$OUT/base}
N=${EVAL_PROBLEMS:-200}
# the longest sorting answer ("0 1 2 3 4 5 6 7 8 9" at most 5 numbers: 9 characters) fits in 12 tokens
GEN=(--max-new-tokens 12 --device cpu)
POST=(--group-size 8 --max-model-len 40 --lr 3e-4 "${GEN[@]}")  # lr: the tiny debug model's (the default 3e-5 is for real models)
mkdir -p "$OUT"
if [ ! -d "$BASE/export" ]; then
  python - "$OUT/solved.jsonl" <<'PY'
import json, random, sys
from openk3.posttrain.tasks import get_task

tasks, rng = [get_task("arithmetic"), get_task("sorting")], random.Random(0)
with open(sys.argv[1], "w") as fh:
    for _ in range(4000):  # documents of 16 solved problems, each of either task
        lines = [(p := rng.choice(tasks).sample(rng)).prompt + p.answer for _ in range(16)]
        fh.write(json.dumps({"text": "\n".join(lines) + "\n"}) + "\n")
PY
  openk3 train --preset debug --data "$OUT/solved.jsonl" --vocab-size 512 --seq-len 128 \
    --out "$BASE" --max-steps "${PRETRAIN_STEPS:-120}" --num-samples 0 --device cpu
fi
evaluate() {  # evaluate NAME CHECKPOINT
  openk3 eval --checkpoint "$2" --task arithmetic sorting --num-problems "$N" "${GEN[@]}" \
    --out "$OUT/eval_$1.json"
}
rm -rf "$OUT/teacher_math" "$OUT/teacher_text" "$OUT/student"
evaluate base "$BASE"
openk3 rl --checkpoint "$BASE" --task arithmetic --out "$OUT/teacher_math" --max-steps "${RL_STEPS:-30}" "${POST[@]}"
openk3 rl --checkpoint "$BASE" --task sorting --out "$OUT/teacher_text" --max-steps "${RL_STEPS:-30}" "${POST[@]}"
openk3 distill --checkpoint "$BASE" --task arithmetic sorting --out "$OUT/student" \
  --teacher "math:*=$OUT/teacher_math" "text:*=$OUT/teacher_text" --max-steps "${DISTILL_STEPS:-40}" "${POST[@]}" ${DISTILL_ARGS:-}
for name in teacher_math teacher_text student; do evaluate "$name" "$OUT/$name"; done
python benchmarks/mopd_table.py "$OUT" --teacher arithmetic=teacher_math sorting=teacher_text
