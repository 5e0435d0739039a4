#!/usr/bin/env bash
# The next one-GPU session's calls (written in the eleventh): measure the decode step as
# committed, then the data for its next kernels. Each call <= ~8 minutes:
#   run(command="bash benchmarks/device_s12.sh N", kind="nvidia-h200", carry=[".whl", ".triton-cache"], timeout_s=595)
# The machine is released 30 s after a call: make the next call at once, or pay its start again.
# 1: the decode steps of `small` at batch 1, 32, 128 and the transformers peer
#    (serve_bench.py --parts decode peer: the eleventh session's last change, the experts'
#    three-kernel GEMVs back and the router GEMV limited to 32 tokens, and the MLA decode's split
#    merge and output gate as one kernel each, are not measured), then the census of one batch-1
#    decode step and of one batch-1 speculative step with K = 3 (where P9's verify cost goes).
# 2: the GPU tests that did not run after the eleventh session's changes (the engine's, the MTP
#    loss, the verify pass, the paged MLA kernels, the compiled gate), then the experts' GEMVs by rows per program and the router's GEMV
#    against cuBLAS by batch (moe_decode_bench.py --rows, --router): where ROWS and
#    LOGITS_GEMV_MAX_TOKENS belong.
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 10 330 python3 benchmarks/serve_bench.py --parts decode peer > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 10 90 python3 benchmarks/decode_census.py --preset small --batch 1 > "$OUT/census_b1.log" 2>&1
  echo "== rc $?" >> "$OUT/census_b1.log"
  [ -f "$OUT/decode_census.json" ] && mv "$OUT/decode_census.json" "$OUT/decode_census_b1.json"
  timeout -k 10 120 python3 benchmarks/decode_census.py --preset small --batch 1 --speculative 3 \
    > "$OUT/census_spec.log" 2>&1
  echo "== rc $?" >> "$OUT/census_spec.log"
  ;;
2)
  gpu_tests 300 tests/ops/test_paged_mla.py tests/ops/test_situ.py tests/serve/test_engine_gpu.py \
    tests/serve/test_verify_gpu.py tests/model/test_gpu.py::test_mtp_loss_fast_path_matches_reference
  timeout -k 10 90 python3 benchmarks/moe_decode_bench.py --presets small --tokens 1 8 32 128 --rows 4 8 \
    > "$OUT/moe_rows.log" 2>&1
  echo "== rc $?" >> "$OUT/moe_rows.log"
  timeout -k 10 90 python3 benchmarks/moe_decode_bench.py --presets small k3 --tokens 1 8 32 64 128 256 --router \
    > "$OUT/router.log" 2>&1
  echo "== rc $?" >> "$OUT/router.log"
  ;;
*) echo "phase 1 or 2" >&2; exit 2 ;;
esac
summary
