#!/usr/bin/env bash
# The twenty-ninth session's device calls:
#   run(command="bash benchmarks/device_s37.sh N", carry=[".whl", ".triton-cache"], timeout_s=595)
# (.whl as device_common.sh says, with the official openai client's wheels added:
#   pip download ... -d .whl openai; the device has no openai package)
# 1: the server over the engine process behind 4, 1 and 2 HTTP server processes (openk3 serve
#    --api-servers N, ApiServers), the official openai client with a thread per stream in 8
#    processes and a raw HTTP client, 64 streams x 128 tokens, every token a chunk.
# 2: the same again at 4, 8 and 1 server processes (call 1: 4 servers 1.085x with the official
#    client, 1 server 1.176x); then the warm/cold time to first token.
# 3: `openk3 serve --random-init` on the GPU with its default server processes (4 on a GPU): a
#    request, /metrics summed over the processes, Ctrl-C.
# 4: the warm request's host time by function (warm_timeline.py --host-profile).
source "$(dirname "$0")/device_common.sh"
case "${1:?phase}" in
1)
  timeout -k 5 560 python3 benchmarks/serve_bench.py --parts server --client-procs 8 \
    --server-engines process --api-servers 4 1 2 --clients threads raw > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  ;;
2)
  timeout -k 5 400 python3 benchmarks/serve_bench.py --parts server --client-procs 8 \
    --server-engines process --api-servers 4 8 1 --clients threads raw > "$OUT/serve.log" 2>&1
  echo "== rc $?" >> "$OUT/serve.log"
  timeout -k 5 150 python3 benchmarks/serve_bench.py --parts ttft > "$OUT/ttft.log" 2>&1
  echo "== rc $?" >> "$OUT/ttft.log"
  ;;
3)  # `openk3 serve` as a user runs it on a GPU: its default server processes, a request, /metrics, Ctrl-C
  python3 -m openk3 serve --random-init --port 18200 > "$OUT/cli.log" 2>&1 &
  pid=$!
  timeout -k 5 150 python3 - > "$OUT/cli_client.log" 2>&1 <<'PY'
import json, time, urllib.request
url = "http://127.0.0.1:18200"
for _ in range(180):
    try:
        urllib.request.urlopen(url + "/health", timeout=1); break
    except OSError:
        time.sleep(1)
body = json.dumps({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
for _ in range(4):
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    print(json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"])
print([l for l in urllib.request.urlopen(url + "/metrics").read().decode().splitlines() if "finished_total" in l])
PY
  kill -INT $pid  # at once, as the twenty-ninth session's call 5 did (its servers still starting)
  for _ in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -0 $pid 2>/dev/null && { echo "== still running 60 s after SIGINT" >> "$OUT/cli_client.log"; kill -9 $pid; }
  wait $pid; echo "== serve rc $?" >> "$OUT/cli_client.log"
  ;;
4)  # where the warm request's host time goes, by function (cProfile), before cutting it
  timeout -k 5 150 python3 benchmarks/warm_timeline.py --host-profile > "$OUT/host_profile.log" 2>&1
  echo "== rc $?" >> "$OUT/host_profile.log"
  ;;
*) echo "phase 1 to 4" >&2; exit 2 ;;
esac
summary
