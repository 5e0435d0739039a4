#!/usr/bin/env bash
# Issue P14 (scaling on 4-8 GPUs), one call per phase on nvidia-h200-x4 or -x8 (the GPU count is
# read from the machine; N runs over 2, 4 and 8 up to it):
#   run(command="bash benchmarks/device_p14.sh N", kind="nvidia-h200-x8", carry=[".whl", ".triton-cache"], timeout_s=595)
# 1: MoonEP vs plain expert parallelism, the routed experts' forward + backward alone
#    (benchmarks/moonep_ep.py: uniform, Zipf and hot-expert routing; the slowest rank's time) at
#    the `small` and `medium` shapes, N = 2, 4, 8.
# 2: the same comparison in whole training steps of `small`: `openk3 train --ep N` with MoonEP
#    and with --no-ep-replicate (plain EP), 30 steps each, N = 2, 4, 8.
# 3: FSDP2 scaling: `small` on 1, 2, 4, 8 GPUs at the same per-GPU batch (tokens/s of all GPUs).
# 4: FSDP2 scaling of `medium` (1, 2, 4, 8 GPUs), then context parallelism: `small` at 256K-1M
#    tokens per sequence with --cp 2, 4, 8 (benchmarks/kcp_bench.py model; the longest that fits).
# Results in docs/benchmarks.md. Checked on the CPU with gloo at 4 and 8 processes (moonep_ep.py
# tiny shapes, the trainer tests with --ep 2 and --no-ep-replicate); not run on a GPU yet.
source "$(dirname "$0")/device_common.sh"
NGPU=$(nvidia-smi -L | wc -l)
sizes() { for n in "$@"; do [ "$n" -le "$NGPU" ] && echo "$n"; done; }
steps() {  # steps SECONDS NAME NPROC EXTRA...: 30 logged training steps, no compile (startup)
  train_run "$1" "$2" "$3" --max-steps 30 --warmup-steps 3 --log-interval 5 --no-compile "${@:4}"
}
case "${1:?phase}" in
1)
  for n in $(sizes 2 4 8); do
    for shape in small medium; do
      timeout -k 5 60 torchrun --standalone --nproc-per-node "$n" -m benchmarks.moonep_ep --shape "$shape" \
        >> "$OUT/moonep_ep.log" 2>&1; echo "== $shape x$n: rc $?" >> "$OUT/moonep_ep.log"
    done
  done
  ;;
2)
  for n in $(sizes 2 4 8); do
    steps 90 "ep${n}_moonep" "$n" --preset small --ep "$n"
    steps 90 "ep${n}_plain" "$n" --preset small --ep "$n" --no-ep-replicate
  done
  ;;
3) for n in $(sizes 1 2 4 8); do steps 120 "fsdp${n}_small" "$n" --preset small; done ;;
4)
  for n in $(sizes 1 2 4 8); do steps 100 "fsdp${n}_medium" "$n" --preset medium; done
  for n in $(sizes 2 4 8); do
    timeout -k 10 100 torchrun --standalone --nproc-per-node "$n" benchmarks/kcp_bench.py model --cp "$n" \
      --steps 1 --no-compile --seq-lens 262144 524288 1048576 >> "$OUT/kcp_cp$n.log" 2>&1
    echo "== cp $n: rc $?" >> "$OUT/kcp_cp$n.log"
  done
  ;;
*) echo "phase 1, 2, 3 or 4" >&2; exit 2 ;;
esac
summary
