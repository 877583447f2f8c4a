#!/usr/bin/env bash
# Sanitizer builds (clang-14, -O1 -g1, no benchmark) and their test runs; deploy/test.sh runs both.
#   tests/sanitizers/run.sh asan   ASan + UBSan + LeakSanitizer, build-asan/: the ctest suites that
#                                  run our C++ (not OutOfMemoryTest, see below)
#   tests/sanitizers/run.sh tsan   ThreadSanitizer, build-tsan/: the server tests (ctest label
#                                  "server", which holds the scheduler's) but ShutdownTest
#   tests/sanitizers/run.sh MODE --build-only   the build alone (deploy/test.sh starts both early,
#                                  in the background); a run waits for a build of its tree that
#                                  is going on (a lock), then finds it done
# clang, not gcc: gcc's TSan crashes at load on the target_clones resolver of the attention tiles.
# Any sanitizer report fails the test it happens in (-fno-sanitize-recover, TSan's exit code 66).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode="${1:?usage: tests/sanitizers/run.sh asan|tsan [--build-only]}"
build_only=0
[[ "${2:-}" == --build-only ]] && build_only=1
source deploy/build-env.sh  # before tsan sets OMP_NUM_THREADS
here="$PWD/tests/sanitizers"
export UBSAN_OPTIONS="print_stacktrace=1"
case "$mode" in
  asan)
    # Not OutOfMemoryTest: it caps the address space (RLIMIT_AS) to make allocations fail, and
    # ASan's own runtime then fails to map memory and hangs in its report.
    # Nor the labels whose tests check what other programs do with ours (Kubernetes manifests,
    # the docs' commands, the Node client, a browser drawing a report, a Prometheus scraping):
    # their calls into our C++ are the ones the C++ suites make.
    build=build-asan sanitize=address,undefined targets=(all)
    suites=(run_suites "$build" 'deploy|docs|node|browser|prometheus' -E '^OutOfMemoryTest\.')
    # Leaks: gRPC's c-ares resolver state is freed after LSan looks (lsan.supp says why).
    export ASAN_OPTIONS="detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
    export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0"
    ;;
  tsan)
    # Not ShutdownTest: it expects four 4096-token calls to be queued within 2 s, which the
    # TSan-slowed client misses on a loaded machine (1 run in 3 here); the drain is still run
    # under TSan by ProcessTest.SigtermFinishesCallsInFlightAndExitsZero.
    # Nor prometheus_scrape (what a Prometheus makes of /metrics; MetricsPortTest races scrapes).
    # (Only server_tests is built, and none of its tests is labelled core: one ctest.) Two tests
    # at a time, unlike run_suites' server suites: this run comes last, with no build in the
    # background to take the CPU a server test leaves while it waits (the cases that must run
    # alone are marked RUN_SERIAL, tests/CMakeLists.txt).
    build=build-tsan sanitize=thread targets=(server_tests)
    suites=(ctest --test-dir "$build" --output-on-failure -j2 -L server -LE prometheus
            -E '^ShutdownTest\.')
    # OpenMP's runtimes (libomp for our kernel, libgomp inside oneDNN) are not instrumented:
    # one compute thread keeps their workers, and TSan's false reports about them, away.
    export OMP_NUM_THREADS=1
    # gRPC, protobuf and absl are Debian's uninstrumented builds: TSan cannot see their locks and
    # atomics, so it judges only accesses made from our (instrumented) code.
    # TSan sleeps at exit (1 s by default) for threads still running to race; ours are joined
    # before, and ctest starts one process a test: 50 ms, not a second a test.
    export TSAN_OPTIONS="suppressions=$here/tsan.supp:ignore_noninstrumented_modules=1:second_deadlock_stack=1:atexit_sleep_ms=50"
    ;;
  *) echo "unknown mode '$mode': asan or tsan" >&2; exit 2 ;;
esac

start=$SECONDS
mkdir -p "$build"
(
  flock 9
  # -Wno-pass-failed: ASan's checks keep clang from vectorizing the loop that
  # core/dnnl_context.cc asks to with `#pragma omp simd`, and it says so ("loop not
  # vectorized"); speed is no aim here.
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_CXX_FLAGS="-Wno-pass-failed" \
    -DATTNSERVE_SANITIZE="$sanitize" \
    -DATTNSERVE_BUILD_BENCH=OFF >/dev/null
  cmake --build "$build" -j"$build_jobs" --target "${targets[@]}"
) 9>"$build/.build-lock"
built=$SECONDS
if (( build_only )); then
  echo "sanitizers $mode: built in $((built - start)) s"
  exit 0
fi
"${suites[@]}"
echo "sanitizers $mode: build $((built - start)) s, tests $((SECONDS - built)) s; CPU (user, sys):"
times
