#!/usr/bin/env bash
# The README's test command (what CI runs, .ci/run): installs what is missing (build and test
# packages), builds, runs every ctest suite, then the checks that need their own build or a
# time bound (each a script of its own, listed below).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --test
deploy/build.sh
ctest --test-dir build --output-on-failure
# Suites with their own builds or time bounds go here, one line each.
deploy/scaleout-test.sh        # issue 13: replicas, client round robin and nginx, a replica killed (~75 s)
