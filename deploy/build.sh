#!/usr/bin/env bash
# Installs what is missing (Debian 12 packages), then configures and builds attnserve into build/.
#   deploy/build.sh [extra cmake args...]
# By default only what serving needs: the server (build/server/attnserve), the client
# (build/client/attnserve-client) and the Python stubs, a couple of minutes from a fresh clone.
# The test suites and the benchmark are asked for (deploy/test.sh does):
#   deploy/build.sh -DATTNSERVE_BUILD_TESTS=ON -DATTNSERVE_BUILD_BENCH=ON
# Extra args come after the defaults, so they win; each run sets both options again, so the same
# build/ goes from one set to the other and back.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
source deploy/build-env.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release \
  -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF "$@"
cmake --build build -j"$build_jobs"
