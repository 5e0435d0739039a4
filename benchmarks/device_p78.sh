#!/usr/bin/env bash
# The device runs of issues P7 (training speed) and P8 (serving speed), in phases of one call
# each on nvidia-h200-x2, every phase under the 600 s limit (results in docs/benchmarks.md):
#   run(command="bash benchmarks/device_p78.sh N", kind="nvidia-h200-x2",
#       carry=[".whl", ".triton-cache", ".old"], timeout_s=598)
# then unpack results.tgz beside the call's files.
# .whl: fla-core and the serving extras as wheels; .triton-cache: the last phase's autotuning
# (unpack $OUT/autotune.tgz into the repo root before the next phase); .old: the openk3 package
# as it landed before this work (git archive 5fd265f openk3), for the loss curve before vs after.
source "$(dirname "$0")/device_common.sh"
if [ "${1:-1}" = 1 ]; then
  # GPU tests of every new kernel and path on one GPU; the headline measurements on the other
  ( export CUDA_VISIBLE_DEVICES=0
    gpu_tests 250 tests/ops
    gpu_tests 170 tests/model tests/serve
    gpu_tests 150 tests/parallel/test_compile.py ) & gpu0=$!
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 280 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 5 > "$OUT/train.log" 2>&1
    timeout 290 python3 benchmarks/serve_bench.py --parts decode peer ttft > "$OUT/serve.log" 2>&1 ) & gpu1=$!
  wait $gpu0 $gpu1
elif [ "$1" = 2 ]; then
  # the GPU tests phase 1 did not reach (newest kernels first); the loss curve before (the
  # landed package in .old) and after, side by side; where the training step's time goes,
  # compiled and eager
  curve=(--preset small --max-steps 200 --warmup-steps 20 --log-interval 5)
  ( export CUDA_VISIBLE_DEVICES=0
    gpu_tests 150 tests/ops/test_varlen_attention.py tests/ops/test_paged_mla.py tests/ops/test_moe.py \
      tests/ops/test_loss.py tests/ops/test_conv.py
    gpu_tests 120 tests/model/test_fuse.py tests/serve/test_engine_gpu.py tests/model/test_gpu.py
    (cd .old && PYTHONPATH=/tmp/site train_run 170 curve_before 1 "${curve[@]}")
    gpu_tests 120 tests/parallel/test_compile.py ) & gpu0=$!
  ( export CUDA_VISIBLE_DEVICES=1
    train_run 230 curve_after 1 "${curve[@]}"
    timeout 100 python3 benchmarks/train_throughput.py --no-compile --no-peer --profile --steps 5 \
      > "$OUT/train_eager.log" 2>&1
    timeout 190 python3 benchmarks/train_throughput.py --compile --no-peer --profile --steps 5 \
      > "$OUT/train_compiled.log" 2>&1 ) & gpu1=$!
  wait $gpu0 $gpu1
elif [ "$1" = 3 ]; then
  # FSDP2 on both GPUs (small, then medium; eager: a fresh machine compiles for ~90 s), sharded
  # checkpoints over NCCL; then the MoE decode kernels and the engine's copy count beside long
  # contexts and the OpenAI server
  train_run 90 small_2gpu 2 --preset small --max-steps 30 --warmup-steps 5 --log-interval 5 --no-compile
  train_run 110 medium_2gpu 2 --preset medium --max-steps 15 --warmup-steps 3 --log-interval 3 --no-compile
  gpu_tests 50 tests/train/test_checkpoint_dcp.py
  ( export CUDA_VISIBLE_DEVICES=0; timeout 120 python3 benchmarks/moe_decode_bench.py > "$OUT/moe.log" 2>&1
    gpu_tests 60 tests/serve/test_engine_gpu.py -k copies ) & gpu0=$!
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 190 python3 benchmarks/serve_bench.py --parts long server > "$OUT/serve2.log" 2>&1 ) & gpu1=$!
  wait $gpu0 $gpu1
fi
summary
