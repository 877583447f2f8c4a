#!/usr/bin/env bash
# Builds the attnserve container image from this checkout, with podman or docker.
#   deploy/docker-build.sh                       image `attnserve`, podman if present, else docker
#   IMAGE=attnserve:1 ENGINE=docker deploy/docker-build.sh [more build flags...]
#   CONTEXT=DIR deploy/docker-build.sh           build another tree (docker-smoke.sh --from-head)
# The build stage starts from debian:bookworm. Where only debian:bookworm-slim is present (an
# offline host), the build stage uses it instead: install-deps.sh installs what the build needs
# either way. Neither present: the engine pulls debian:bookworm as usual.
# podman writes OCI images by default, which drop the Dockerfile's HEALTHCHECK: it is asked for
# the docker format.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
IMAGE=${IMAGE:-attnserve}
CONTEXT=${CONTEXT:-.}

has_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
flags=(-t "$IMAGE")
if ! has_image debian:bookworm && has_image debian:bookworm-slim; then
  echo "debian:bookworm not present: building on the local debian:bookworm-slim"
  flags+=(--build-arg BUILD_IMAGE=debian:bookworm-slim)
fi
# Use local base images when present; pull only what is missing.
[[ "$ENGINE" == podman ]] && flags+=(--format docker --pull=missing)
start=$SECONDS
"$ENGINE" build "${flags[@]}" "$@" "$CONTEXT"
echo "image $IMAGE built in $((SECONDS - start)) s ($ENGINE)"
