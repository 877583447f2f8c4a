#!/usr/bin/env bash
# Installs what is missing (Debian 12 packages), then configures and builds attnserve into build/.
#   deploy/build.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build -j"$(nproc)"
