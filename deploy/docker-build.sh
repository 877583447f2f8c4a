#!/usr/bin/env bash
# Builds the attnserve container image from this checkout, with docker or podman.
#   deploy/docker-build.sh                       image `attnserve`, docker if present, else podman
#   IMAGE=attnserve:1 ENGINE=docker deploy/docker-build.sh [more build flags...]
#   CONTEXT=DIR deploy/docker-build.sh           build another tree (docker-smoke.sh --from-head)
# The build stage starts from debian:bookworm. Where only debian:bookworm-slim is present (an
# offline host), the build stage uses it instead: install-deps.sh installs what the build needs
# either way. Neither present: the engine pulls debian:bookworm as usual.
# podman writes OCI images by default, which drop the Dockerfile's HEALTHCHECK: it is asked for
# the docker format.
set -euo pipefail
cd "$(dirname "$0")/.."
# The engine: $ENGINE, else docker when present, else podman (deploy/docker-smoke.sh chooses alike).
ENGINE=${ENGINE:-$(command -v docker >/dev/null && echo docker || echo podman)}
IMAGE=${IMAGE:-attnserve}
CONTEXT=${CONTEXT:-.}

has_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }
flags=(-t "$IMAGE")
if ! has_image debian:bookworm && has_image debian:bookworm-slim; then
  echo "debian:bookworm not present: building on the local debian:bookworm-slim"
  flags+=(--build-arg BUILD_IMAGE=debian:bookworm-slim)
fi
# Use local base images when present; pull only what is missing.
# (podman-docker's `docker` is podman too: asked by its version.)
if [[ "$ENGINE" == podman ]] || "$ENGINE" --version 2>/dev/null | grep -qi podman; then
  flags+=(--format docker --pull=missing)
fi
start=$SECONDS
"$ENGINE" build "${flags[@]}" "$@" "$CONTEXT"
echo "image $IMAGE built in $((SECONDS - start)) s ($ENGINE)"
