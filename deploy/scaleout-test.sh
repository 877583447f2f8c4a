#!/usr/bin/env bash
# Scale-out on loopback, for real: attnserve replicas, the bundled load tester and nginx.
#   deploy/scaleout-test.sh            (run by deploy/test.sh; about 80 s, stops by itself)
# (a) three replicas, the load tester balancing itself (round_robin over ipv4:A,B,C, 16 callers);
#     one replica is killed (SIGKILL) a third of the way in;
# (b) the same through nginx (deploy/nginx/attnserve.conf as shipped, listen address aside);
# (c) three replicas behind a DNS name (a stand-in for a Kubernetes headless Service) with a short
#     --max-connection-age; a fourth replica is added to the name while the load runs.
# Asserts: no failed call in (a) and (b) (the client's default retry policy and nginx's
# grpc_next_upstream move the calls of the dead replica elsewhere); each replica served its fair
# share (within 25 % of even) before the kill; in (c) the new replica gets calls once the
# connections reach their age (+ gRPC's 30 s floor between DNS resolutions), then its share; a
# call may fail there only as gRPC 1.51 fails one racing a connection's age (at most 1 in 10,000,
# UNAVAILABLE with the connection reset: docs/deployment.md#new-replicas).
# Calls are counted from each replica's own log (--log-level debug: one JSON line per call).
# Every address is on loopback: 127.0.0.1, and 127.0.0.2-4 in (c), which a DNS A record needs
# since it has no port. Needs: nginx, /usr/bin/python3, a build (deploy/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
SERVER=${SERVER:-build/server/attnserve}
CLIENT=${CLIENT:-build/client/attnserve-client}
NGINX=${NGINX:-/usr/sbin/nginx}
DURATION=${DURATION:-12}   # seconds of load in (a) and (b)
AGE=${AGE:-8}              # --max-connection-age in (c)
CALLERS=16
# One call per line in a replica's debug log (the "forward" line of each answered call).
CALL_LINE='"msg":"forward"'
for tool in "$SERVER" "$CLIENT" "$NGINX"; do
  [[ -x "$tool" ]] || { echo "scaleout: no $tool (deploy/build.sh; nginx: deploy/install-deps.sh --test)" >&2; exit 1; }
done

WORK=$(mktemp -d /tmp/attnserve-scaleout.XXXXXX)
declare -A pid port
started=()
cleanup() {
  for p in "${started[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ "${KEEP:-}" == 1 ]]; then echo "logs kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
ts() { date +%s.%N; }

# start_replica NAME HOST:PORT [server flags...]: starts one replica, waits until it listens.
start_replica() {
  local name=$1 listen=$2; shift 2
  rm -f "$WORK/$name.port"
  "$SERVER" --listen "$listen" --port-file "$WORK/$name.port" --threads 1 \
    --log-level debug --log-format json --metrics-listen off --http-listen off "$@" >"$WORK/$name.log" 2>&1 &
  pid[$name]=$!; started+=($!); disown  # no "Killed" notice from bash when the test kills it
  for _ in $(seq 1 300); do
    [[ -s "$WORK/$name.port" ]] && { port[$name]=$(cat "$WORK/$name.port"); return; }
    kill -0 "${pid[$name]}" 2>/dev/null || { cat "$WORK/$name.log" >&2; fail "replica $name did not start"; }
    sleep 0.1
  done
  fail "replica $name wrote no port in 30 s"
}
calls() { grep -c "$CALL_LINE" "$WORK/$1.log" || true; }
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# check_fair PHASE N1 N2 ...: every count within 25 % of the even share.
check_fair() {
  local phase=$1; shift
  local total=0 n; for n in "$@"; do total=$((total + n)); done
  (( total >= 30 )) || fail "$phase: only $total calls before the kill"
  for n in "$@"; do
    # |n - total/k| <= 0.25 * total/k, in integers: |4*k*n - 4*total| <= total
    local dev=$(( 4 * $# * n - 4 * total )); dev=${dev#-}
    (( dev <= total )) || fail "$phase: shares $* of $total calls are not within 25 % of even"
  done
  echo "$phase: calls per replica before the kill: $* (of $total; even share $((total / $#)))"
}

# run_bench PHASE TARGET [client flags...]: the load in the background; its pid in bench_pid.
run_bench() {
  local phase=$1 target=$2; shift 2
  "$CLIENT" --target "$target" "$@" bench --random 2,64 --concurrency $CALLERS \
    --duration "$BENCH_SECONDS" >"$WORK/$phase.bench" 2>&1 &
  bench_pid=$!; started+=($!)
}
# finish_bench PHASE [FAILURES_PER_10000]: waits for the load; fails unless every call succeeded
# (or, given a tolerance, unless the failures are all UNAVAILABLE ones of a reset connection and
# no more than that many per 10,000 calls, at least one).
finish_bench() {
  local code=0
  wait "$bench_pid" || code=$?
  cat "$WORK/$1.bench"
  (( code == 0 )) && return
  if [[ $code == 14 && -n "${2:-}" ]]; then
    local failed sent
    read -r failed sent < <(sed -n 's/^attnserve-client: UNAVAILABLE: \([0-9]*\) of \([0-9]*\) calls failed$/\1 \2/p' "$WORK/$1.bench")
    if [[ -n "$failed" ]] && grep -q '^errors .*UNAVAILABLE: [0-9]* (first: .*Connection reset by peer)$' "$WORK/$1.bench" &&
       (( $(grep -c '^errors ' "$WORK/$1.bench") == 1 && failed * 10000 <= sent * $2 || failed == 1 )); then
      echo "$1: $failed of $sent calls failed as gRPC fails a call racing a connection's age (tolerated)"
      return
    fi
  fi
  fail "$1: the load tester exited $code (failed calls, listed above)"
}

# kill_mid_run PHASE R1 R2 R3: lets a third of the load pass, kills R3, checks the shares.
kill_mid_run() {
  local phase=$1; shift
  sleep "$(awk -v d="$DURATION" 'BEGIN { print d / 3 }')"
  local before=() r; for r in "$@"; do before+=("$(calls "$r")"); done
  kill -KILL "${pid[$3]}"
  echo "$phase: SIGKILL to replica $3 at $(date +%T)"
  check_fair "$phase" "${before[@]}"
}

stop() {  # stop NAME...: SIGTERM, so the next phase has the cores to itself
  local r; for r in "$@"; do kill -TERM "${pid[$r]}" 2>/dev/null || true; done
}
start_all() {  # start_all PREFIX: three replicas on free 127.0.0.1 ports
  local r; for r in "$1"1 "$1"2 "$1"3; do start_replica "$r" 127.0.0.1:0; done
}

begin=$SECONDS
BENCH_SECONDS=$DURATION

# --- (a) client-side round robin over three replicas
start_all a
run_bench a "ipv4:127.0.0.1:${port[a1]},127.0.0.1:${port[a2]},127.0.0.1:${port[a3]}" \
  --lb-policy round_robin
kill_mid_run a a1 a2 a3
finish_bench a
echo "a: after the kill: a1 $(calls a1), a2 $(calls a2) calls in all; round robin + retries: no call lost"
stop a1 a2

# --- (b) nginx balancing per call
start_all b
nport=$(free_port)
mkdir -p "$WORK/nginx"
sed "s/^\(\s*\)listen 50051 http2;/\1listen 127.0.0.1:$nport http2;/" deploy/nginx/attnserve.conf \
  >"$WORK/nginx/attnserve.conf"
grep -q "listen 127.0.0.1:$nport http2;" "$WORK/nginx/attnserve.conf" || fail "no listen line in deploy/nginx/attnserve.conf"
for r in b1 b2 b3; do
  echo "server 127.0.0.1:${port[$r]} max_fails=1 fail_timeout=10s;"
done >"$WORK/nginx/attnserve-replicas.conf"
cat >"$WORK/nginx/nginx.conf" <<EOF
# A private nginx for this test: one process, in the foreground, files under $WORK/nginx.
daemon off;
master_process off;
worker_processes 1;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log notice;
events { worker_connections 1024; }
http {
  log_format upstream '\$status \$upstream_addr \$upstream_status';
  access_log $WORK/nginx/access.log upstream;
  client_body_temp_path $WORK/nginx/body;
  include attnserve.conf;
}
EOF
"$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" &
nginx_pid=$!; started+=($!)
for _ in $(seq 1 100); do
  "$CLIENT" --target "127.0.0.1:$nport" --timeout 2 health >/dev/null 2>&1 && break
  kill -0 "$nginx_pid" 2>/dev/null || { cat "$WORK/nginx/error.log" >&2; fail "nginx did not start"; }
  sleep 0.1
done
run_bench b "127.0.0.1:$nport"
kill_mid_run b b1 b2 b3
finish_bench b
echo "b: nginx answered $(grep -c '^200 ' "$WORK/nginx/access.log" || true) calls 200," \
  "$(grep -vc '^200 ' "$WORK/nginx/access.log" || true) otherwise (retried by the client)"
kill -TERM "$nginx_pid"
stop b1 b2

# --- (c) a fourth replica joins a DNS name; clients reach it once their connections age out
/usr/bin/python3 deploy/scaleout/dns.py --port-file "$WORK/dns.port" --name attnserve.test \
  --addresses "$WORK/addresses" &
started+=($!)
start_replica c1 127.0.0.1:0 --max-connection-age "$AGE" --max-connection-age-grace 5
cport=${port[c1]}
start_replica c2 "127.0.0.2:$cport" --max-connection-age "$AGE" --max-connection-age-grace 5
start_replica c3 "127.0.0.3:$cport" --max-connection-age "$AGE" --max-connection-age-grace 5
printf '127.0.0.1\n127.0.0.2\n127.0.0.3\n' >"$WORK/addresses"
for _ in $(seq 1 50); do [[ -s "$WORK/dns.port" ]] && break; sleep 0.1; done
[[ -s "$WORK/dns.port" ]] || fail "the DNS stand-in did not start"
# attnserve-client re-resolves at most every 2 s (gRPC's default is 30 s), so the newcomer is
# reached within the connection age (plus its 10 % jitter); the load runs long enough to see it,
# then measure its share.
BENCH_SECONDS=$((AGE + 15))
run_bench c "dns://127.0.0.1:$(cat "$WORK/dns.port")/attnserve.test:$cport" --lb-policy round_robin
sleep 2
start_replica c4 "127.0.0.4:$cport" --max-connection-age "$AGE" --max-connection-age-grace 5
echo 127.0.0.4 >>"$WORK/addresses"
joined=$(ts)
echo "c: replica c4 started and added to attnserve.test at $(date +%T)"
first=""
while kill -0 "$bench_pid" 2>/dev/null; do
  if [[ -z "$first" ]] && (( $(calls c4) > 0 )); then
    first=$(ts)
    seen=("$(calls c1)" "$(calls c2)" "$(calls c3)" "$(calls c4)")
  fi
  sleep 0.2
done
finish_bench c 1
[[ -n "$first" ]] || fail "c: replica c4 got no call in ${BENCH_SECONDS} s"
delay=$(awk -v a="$joined" -v b="$first" 'BEGIN { printf "%.1f", b - a }')
limit=$(( AGE * 11 / 10 + 3 ))
awk -v d="$delay" -v l="$limit" 'BEGIN { exit !(d <= l) }' || fail "c: c4's first call came ${delay} s after it joined (limit ${limit} s)"
after=()
for i in 1 2 3 4; do after+=($(( $(calls c$i) - ${seen[$((i - 1))]} ))); done
total=$(( after[0] + after[1] + after[2] + after[3] ))
(( total >= 30 )) || fail "c: only $total calls after c4 joined"
# c4's share of the calls after its first one: at least 75 % of even (a quarter).
(( 16 * after[3] >= 3 * total )) || fail "c: c4 served ${after[3]} of $total calls after joining (even: $((total / 4)))"
echo "c: c4 got its first call ${delay} s after joining (age ${AGE} s, re-resolution floor 2 s);" \
  "then calls per replica ${after[*]} (of $total)"
echo "scale-out test passed in $((SECONDS - begin)) s"
