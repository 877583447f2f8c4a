#!/bin/bash
# swap_load.sh BUILD_DIR MODE SECONDS: a steady load (4 callers, 1x128 calls of the demo layer)
# against attnserve while (MODE=swap) a 4096-wide layer (W_q/W_k/W_v, 201 MB a version, written
# here into /tmp/attnserve-swap, never committed) swaps between two versions in poll mode every
# ~2 s, or (MODE=idle) sits loaded. Prints the client's latency summary, the server's CPU (clock
# ticks from /proc/PID/stat) over the run, and its resident memory: at start, at peak (VmHWM),
# at the end. By hand, on an otherwise idle machine; run idle and swap alternately.
set -u
BUILD=$1 MODE=$2 SECONDS_=$3
REPO=/tmp/attnserve-swap
if [ ! -s $REPO/big/2/model.safetensors ]; then
  mkdir -p $REPO/big/1 $REPO/big/2
  for v in 1 2; do python3 - $REPO/big/$v/model.safetensors $v <<'PY'
import array, json, math, struct, sys
d, path, seed = 4096, sys.argv[1], int(sys.argv[2])
row = array.array("f", [0.02 * math.sin(0.37 * i + seed) for i in range(d)]).tobytes()
header, offset = {"__metadata__": {"num_heads": "32"}}, 0
for name in ("W_q.weight", "W_k.weight", "W_v.weight"):
    header[name] = {"dtype": "F32", "shape": [d, d], "data_offsets": [offset, offset + d * d * 4]}
    offset += d * d * 4
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text)
    for _ in range(3):
        f.write(row * d)
PY
  done
fi
policy() { echo "{\"version_policy\": {\"specific\": {\"versions\": [$1]}}}" > $REPO/big/.c && mv $REPO/big/.c $REPO/big/config.json; }
policy 1
rm -f $REPO.port
$BUILD/server/attnserve --listen 127.0.0.1:0 --port-file $REPO.port --metrics-listen off \
  --model demo=built-in --model-repository $REPO --model-control-mode poll \
  --repository-poll-secs 0.2 > $REPO.log 2>&1 &
SERVER=$!
until [ -s $REPO.port ]; do sleep 0.2; done
sleep 1
RSS0=$(awk '/VmRSS/ {print $2}' /proc/$SERVER/status)
cpu() { awk '{print $14 + $15}' /proc/$SERVER/stat; }
if [ "$MODE" = swap ]; then
  (v=1; while kill -0 $SERVER 2>/dev/null; do v=$((3 - v)); policy $v; sleep 2; done) &
  TOGGLE=$!
fi
C0=$(cpu)
$BUILD/client/attnserve-client --target 127.0.0.1:$(cat $REPO.port) bench --model demo \
  --random 1,128 --concurrency 4 --duration $SECONDS_ --json > $REPO.$MODE.json
C1=$(cpu)
[ "$MODE" = swap ] && kill $TOGGLE
echo "$MODE server_cpu_ticks=$((C1 - C0)) rss_start_kib=$RSS0" \
  "rss_peak_kib=$(awk '/VmHWM/ {print $2}' /proc/$SERVER/status)" \
  "rss_end_kib=$(awk '/VmRSS/ {print $2}' /proc/$SERVER/status)" \
  "loads=$(grep -c 'model version ready' $REPO.log)"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('ok', r['ok'], 'errors', r['errors'], 'latency_ms', r['latency_ms'])" $REPO.$MODE.json
kill $SERVER
wait $SERVER 2>/dev/null || true
