#!/usr/bin/env bash
# Builds the attnserve image, runs it, calls it from the host with attnserve-client (health,
# models, infer), stops it with SIGTERM and checks that it exited cleanly. Prints the image size.
#   deploy/docker-smoke.sh [--from-head]
#     --from-head   build from the committed tree (git archive HEAD) instead of the checkout
#   SKIP_BUILD=1 deploy/docker-smoke.sh   reuses an image built before ($IMAGE)
# Needs docker or podman (ENGINE=..., default docker when present, else podman, as
# deploy/docker-build.sh chooses) and a host attnserve-client (CLIENT=..., default
# build/client/attnserve-client; deploy/build.sh makes it). The image is built by
# deploy/docker-build.sh (which also copes with a host that has only debian:bookworm-slim).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-$(command -v docker >/dev/null && echo docker || echo podman)}
IMAGE=${IMAGE:-attnserve:smoke}
PORT=${PORT:-50551}
CLIENT=${CLIENT:-build/client/attnserve-client}
NAME=attnserve-smoke-$$

[[ -x "$CLIENT" ]] || { echo "no $CLIENT: run deploy/build.sh first (or set CLIENT)" >&2; exit 1; }

context=.
if [[ "${1:-}" == "--from-head" ]]; then
  context=$(mktemp -d)
  trap 'rm -rf "$context"' EXIT
  git archive HEAD | tar -x -C "$context"
fi
[[ "${SKIP_BUILD:-}" == 1 ]] || ENGINE=$ENGINE IMAGE=$IMAGE CONTEXT=$context deploy/docker-build.sh

cleanup() { $ENGINE rm -f "$NAME" >/dev/null 2>&1 || true; }
trap 'cleanup; [[ "$context" != . ]] && rm -rf "$context"' EXIT
$ENGINE run -d --name "$NAME" -p "127.0.0.1:$PORT:50051" "$IMAGE" >/dev/null
target="127.0.0.1:$PORT"
for _ in $(seq 1 60); do
  "$CLIENT" --target "$target" --timeout 2 health >/dev/null 2>&1 && break
  sleep 1
done
"$CLIENT" --target "$target" health
"$CLIENT" --target "$target" models
"$CLIENT" --target "$target" infer --random 2,8 --lengths 8,5 --kind causal
# The image's own HEALTHCHECK, run once by hand: podman schedules it with systemd timers, which
# a host without systemd lacks (it logs "unable to get systemd connection", harmlessly).
if [[ "$ENGINE" == podman ]]; then
  $ENGINE healthcheck run "$NAME" && echo "HEALTHCHECK: healthy"
else
  $ENGINE exec "$NAME" attnserve-client --target 127.0.0.1:8081 health
fi
echo "user in the container: $($ENGINE exec "$NAME" id -u)"

$ENGINE stop --time 30 "$NAME" >/dev/null  # SIGTERM, then SIGKILL after 30 s
code=$($ENGINE inspect --format '{{.State.ExitCode}}' "$NAME")
$ENGINE logs "$NAME" 2>&1 | tail -n 4
[[ "$code" == 0 ]] || { echo "FAIL: exit code $code after SIGTERM" >&2; exit 1; }
echo "clean exit (0) after SIGTERM"

# A model of your own, mounted read-only under /models (here a PyTorch golden fixture).
model=$PWD/tests/fixtures/w_torch_mha.safetensors
if [[ -f "$model" ]]; then
  $ENGINE run -d --name "$NAME-model" -p "127.0.0.1:$PORT:50051" \
    -v "$model:/models/mha.safetensors:ro" "$IMAGE" \
    --listen 0.0.0.0:50051 --health-listen 0.0.0.0:8081 --model mha=/models/mha.safetensors >/dev/null
  trap 'cleanup; $ENGINE rm -f "$NAME-model" >/dev/null 2>&1; [[ "$context" != . ]] && rm -rf "$context"' EXIT
  for _ in $(seq 1 60); do
    "$CLIENT" --target "$target" --timeout 2 health >/dev/null 2>&1 && break
    sleep 1
  done
  "$CLIENT" --target "$target" models
  "$CLIENT" --target "$target" infer --model mha --random 1,4 --kind causal
  $ENGINE stop --time 30 "$NAME-model" >/dev/null
fi
echo "image size: $($ENGINE image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f MB", $1/1e6}')"
echo "docker smoke test passed"
