#!/usr/bin/env bash
# The README's test command (what CI runs, .ci/run): installs what is missing (build and test
# packages), checks the formatting, builds with the test suites, runs every ctest suite, then the
# checks that need their own build or a time bound (each a script of its own, listed below).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --test
# npm (client_node_packages, deploy_k8s_packages) keeps its cache and logs in build/, not ~/.npm.
export npm_config_cache="$PWD/build/npm-cache" npm_config_logs_dir="$PWD/build/npm-cache/_logs"
# Formatting first: a few seconds, and a misformatted file fails before minutes of build.
deploy/check-format.sh
deploy/build.sh -DATTNSERVE_BUILD_TESTS=ON -DATTNSERVE_BUILD_BENCH=ON  # build.sh alone: serving only
# The sanitizer builds start now, in the background at the lowest priority: they take the CPU the
# suites below leave while they wait on servers. Each sanitizer's run below waits for its build
# to end (a lock) and finds it done; a build that failed fails again there, in the log.
mkdir -p build
# (Its own session, so that the trap below can end all of it; a session is a scheduling group of
# its own where the kernel groups them, so that group gets the lowest priority too.)
setsid nice -n 19 bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true
  tests/sanitizers/run.sh asan --build-only
  tests/sanitizers/run.sh tsan --build-only' >build/sanitizer-builds.log 2>&1 &
background=$!
trap 'kill -- "-$background" 2>/dev/null || true' EXIT
source deploy/build-env.sh
run_suites build ''
# Suites with their own builds or time bounds go here, one line each.
deploy/scaleout-test.sh        # replicas: client round robin and nginx, a replica killed (~75 s)
tests/fuzz/run.sh 30           # libFuzzer harnesses side by side for 30 s (build-fuzz/, clang-14)
tests/sanitizers/run.sh asan   # ASan + UBSan build, the suites that run our C++ (build-asan/)
tests/sanitizers/run.sh tsan   # TSan build, the server tests (build-tsan/)
