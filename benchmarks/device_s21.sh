#!/usr/bin/env bash
# The sixteenth session's device calls:
#   run(command="bash benchmarks/device_s21.sh N", kind=KIND, carry=[".whl", ".triton-cache", ".warm"], timeout_s=595)
# .whl and .warm as device_common.sh says. The machine is released 30 s after a call.
# 1 (nvidia-h200): P7 with RMSNorm as openk3's Triton kernels (72 norms a step outside the compiled
#    regions, ~147 us each by inductor at `small`'s shape) and Newton-Schulz normalising through
#    its first Gram matrix (the norm and broadcast division over every momentum, 2.7 ms): the GPU
#    tests of both beside a 200-step curve, norm_speed.py at the layers' width and the MoE
#    latent's, the step against the peer with its profile, the census.
# 2 (nvidia-h200): P8's decode step against the peer and its census, the norms now Triton there too.
# 3 (nvidia-h200): call 1's follow-up (below), with the serving engine's GPU tests (its norms
#    are the Triton kernels now too).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  curve_beside_tests 230 200 tests/ops/test_norm.py tests/train/test_optim.py
  for d in 1024 512; do
    timeout -k 10 60 python3 benchmarks/norm_speed.py --hidden $d > "$OUT/norm_speed_$d.log" 2>&1
    echo "== rc $?" >> "$OUT/norm_speed_$d.log"
  done
  throughput_and_census
  ;;
3)  # after call 1: the backward as the unrounded derivative, its partial sums by a Triton kernel
  # (torch's sum over the programs cost 15.6 us a norm), tiles and programs per SM swept; QB's
  # per-expert thresholds by a bisection kernel (torch's kthvalue: 0.61 ms); the routers' fp32
  # logits and gradients by bf16 GEMMs on the weight's two bf16 halves (three fp32 GEMMs a layer:
  # ~4 ms a step)
  curve_beside_tests 230 220 tests/ops/test_norm.py tests/ops/test_router.py tests/serve/test_engine_gpu.py
  timeout -k 10 90 python3 benchmarks/norm_speed.py --hidden 1024 > "$OUT/norm_speed_1024.log" 2>&1
  echo "== rc $?" >> "$OUT/norm_speed_1024.log"
  timeout -k 10 200 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  ;;
4)  # after call 3: the weight gradient's column sums 32 columns a program (4 programs of 256
  # took 31.6 us a norm), the bisection kernel's counts on int32 keys (282 us for 1,472 rows)
  timeout -k 10 150 python3 benchmarks/train_throughput.py --batch 4 --seq 4096 --steps 10 --profile \
    > "$OUT/throughput.log" 2>&1
  echo "== rc $?" >> "$OUT/throughput.log"
  gpu_tests 80 tests/ops/test_norm.py tests/ops/test_router.py -k "triton or kth or split or logits"
  ;;
2)  # P8: the decode step against the peer and its census (device_s12.sh 1 without the speculative census)
  timeout -k 10 330 python3 benchmarks/serve_bench.py --parts decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 10 90 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census_b1.log" 2>&1
  echo "== rc $?" >> "$OUT/census_b1.log"
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
