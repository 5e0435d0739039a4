#!/usr/bin/env bash
# Issue P12 on one H200: RL accuracy curves on arithmetic and code, and MOPD from two teachers,
# on the `small` preset. scripts/mopd_demo.sh (the CPU demo on `debug`) scaled up, by phase:
#   run(command="bash benchmarks/device_p12_mopd.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"],
#       timeout_s=598)
# Each phase fits in ~550 s (every stage has its own limit; training stages are stopped by SIGINT,
# which saves and exports the run, so a stage cut short still leaves a model). Runs live in
# /tmp/p12m, which only a warm machine keeps between calls: phases 2 and 3 need what phase 1
# (and 2) left there, and say so and stop if it is missing (a cold machine: start from phase 1).
# 1: solved text of arithmetic (2 digits) and python functions, written by the tasks; pre-train
#    `small` on it (vocab 1024, a short run so that the base is middling and RL has room); eval
#    the base on both tasks. Needs nothing. (The seventh session's 300 steps, ~125 s, gave a
#    base at 0.085 on arithmetic and 0.000 on python: no reward for RL to climb; now 800. The
#    eighth's 800 steps gave 0.365 and 1.000: python saturated, every family being in the text;
#    the text now leaves out the families in HELD_OUT, which RL and the evaluations still ask.)
# 2 [math|code]: RL teacher_math on arithmetic and teacher_code on python (default both, one
#    after the other), each from the base: the accuracy curves (sampled, per step) are
#    rl_*.metrics.jsonl in $OUT. Needs phase 1's base.
# 3: MOPD student from the base with both teachers (math:*, code:*) and the task reward beside
#    theirs (--reward-weight 1: the CPU demo's student reached 1.00 / 0.99 of its teachers so,
#    0.87 / 0.97 with the teachers alone); eval the teachers and the
#    student; the table base / teachers / student and student / teacher. Needs phases 1 and 2.
#    Its parts, for two GPUs side by side: `distill` (the student and its eval), `eval-teachers`,
#    `table`.
# RL and distillation run at openk3's default lr (3e-5 since the eighth session: 3e-4 took the
# base's arithmetic from 0.365 to 0.120).
# Step counts: PRETRAIN_STEPS (800), RL_STEPS (60), DISTILL_STEPS (40), EVAL_PROBLEMS (200); limits in
# seconds RL_LIMIT (240 each), DISTILL_LIMIT (260); PRESET
# (small) and DEVICE (cuda) too, for checking the command lines on the CPU with `debug`.
# Results: $OUT/*.log, *.metrics.jsonl, eval_*.json, mopd_table.md (docs/posttraining.md).
source "$(dirname "$0")/device_common.sh"
R=/tmp/p12m
MATH=arithmetic:digits=2
# python families absent from the pre-training text, each near one that is there (+ -> *, max -> min,
# xs[0] -> xs[-1], s[::-1] -> s.upper()): the base solves about 12 of 16, RL can find the rest
HELD_OUT=${HELD_OUT:-times,smaller,last,shout}
# a python body is one line of up to ~40 characters; a prompt ~25 tokens at vocab 1024
DEVICE=${DEVICE:-cuda}
POST=(--group-size 8 --prompts-per-step 8 --max-new-tokens 48 --max-model-len 128 --ckpt-interval 100000
  --device "$DEVICE")
stage() {  # stage SECONDS NAME OPENK3-ARGS...: python -m openk3 ARGS, SIGINT at the limit (save + export)
  local limit=$1 name=$2; shift 2
  timeout -s INT -k 60 "$limit" python3 -m openk3 "$@" > "$OUT/$name.log" 2>&1
  echo "== rc $?" >> "$OUT/$name.log"
}
needs() {  # needs DIR...: each must hold an exported model
  for d in "$@"; do
    [ -d "$d/export" ] || { echo "phase $PHASE needs $d/export, which an earlier phase writes on this warm" \
      "machine; a cold machine has lost it: run the phases from 1" | tee -a "$OUT/phase$PHASE.log"; exit 3; }
  done
}
evaluate() {  # evaluate SECONDS NAME CHECKPOINT: both tasks, greedy, held-out problems
  timeout -k 10 "$1" python3 -m openk3 eval --checkpoint "$3" --task "$MATH" python \
    --num-problems "${EVAL_PROBLEMS:-200}" --max-new-tokens 48 --device "$DEVICE" --out "$OUT/eval_$2.json" \
    > "$OUT/eval_$2.log" 2>&1
  echo "== rc $?" >> "$OUT/eval_$2.log"
  cp "$OUT/eval_$2.json" "$R/" 2>/dev/null
}
PHASE=${1:?phase}
mkdir -p "$R"
distill() {
  needs "$R/base" "$R/teacher_math" "$R/teacher_code"
  rm -rf "$R/student"
  stage "${DISTILL_LIMIT:-260}" distill distill --checkpoint "$R/base" --task "$MATH" python --out "$R/student" \
    --teacher "math:*=$R/teacher_math" "code:*=$R/teacher_code" --max-steps "${DISTILL_STEPS:-40}" --reward-weight 1 "${POST[@]}"
  cp "$R/student/metrics.jsonl" "$OUT/distill.metrics.jsonl" 2>/dev/null
  evaluate 80 student "$R/student"
}
# 150 s each: beside the distillation on one GPU, 80 s was too short (eighth session)
eval_teachers() { for name in teacher_math teacher_code; do evaluate 150 "$name" "$R/$name"; done; }
table() {
  cp "$R/eval_base.json" "$OUT/" 2>/dev/null
  python3 benchmarks/mopd_table.py "$OUT" --teacher "$MATH"=teacher_math python=teacher_code \
    | tee "$OUT/mopd_table.md"
}
case "$PHASE" in
1)
  rm -rf "$R/base"
  python3 - "$R/solved.jsonl" "$MATH" "$HELD_OUT" <<'PY'
import json, random, sys
from openk3.posttrain.tasks import FAMILIES, parse_task

held_out = set(sys.argv[3].split(","))
if held_out - set(FAMILIES):
    sys.exit(f"HELD_OUT: unknown python families {sorted(held_out - set(FAMILIES))}; known: {list(FAMILIES)}")
seen = ",".join(f for f in FAMILIES if f not in held_out)
tasks, rng = [parse_task(sys.argv[2]), parse_task(f"python:families={seen}")], random.Random(0)
with open(sys.argv[1], "w") as fh:
    for _ in range(20000):  # documents of 16 solved problems, each ending as generation stops
        fh.write(json.dumps({"text": "".join((p := rng.choice(tasks).sample(rng)).prompt + p.answer + p.stop[0]
                                             for _ in range(16))}) + "\n")
PY
  stage 440 pretrain train --preset "${PRESET:-small}" --data "$R/solved.jsonl" --vocab-size 1024 --seq-len 512 \
    --batch-size 16 --max-steps "${PRETRAIN_STEPS:-800}" --warmup-steps $(( ${PRETRAIN_STEPS:-800} / 15 )) --log-interval 10 \
    --eval-interval 100000 --ckpt-interval 100000 --num-samples 0 --no-compile --device "$DEVICE" --out "$R/base"
  cp "$R/base/metrics.jsonl" "$OUT/pretrain.metrics.jsonl" 2>/dev/null
  evaluate 100 base "$R/base"
  ;;
2)
  needs "$R/base"
  for t in math:"$MATH" code:python; do
    [ -n "${2:-}" ] && [ "$2" != "${t%%:*}" ] && continue
    rm -rf "$R/teacher_${t%%:*}"
    stage "${RL_LIMIT:-240}" "rl_${t%%:*}" rl --checkpoint "$R/base" --task "${t#*:}" --out "$R/teacher_${t%%:*}" \
      --max-steps "${RL_STEPS:-60}" "${POST[@]}"
    cp "$R/teacher_${t%%:*}/metrics.jsonl" "$OUT/rl_${t%%:*}.metrics.jsonl" 2>/dev/null
  done
  ;;
3) distill; eval_teachers; table ;;
distill) distill ;;
eval-teachers) needs "$R/teacher_math" "$R/teacher_code"; eval_teachers ;;
table) table ;;
*) echo "phase 1, 2 [math|code], 3, distill, eval-teachers or table" >&2; exit 2 ;;
esac
summary
