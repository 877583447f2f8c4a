#!/usr/bin/env bash
# Builds the libFuzzer harnesses (clang-14, ASan + UBSan, in build-fuzz/) and runs them side by
# side for SECONDS (default 60; deploy/test.sh runs 30). A longer run, e.g. an hour:
#   nice -n 19 tests/fuzz/run.sh 3600
# The corpus a run grows stays in build-fuzz/corpus/<harness> and seeds the next run; a crash
# is written to build-fuzz/crashes/ and fails the script. Reproduce one with
#   build-fuzz/tests/fuzz/<harness> build-fuzz/crashes/<file>
#   tests/fuzz/run.sh [SECONDS] [HARNESS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
shift || true
harnesses=("$@")
(( ${#harnesses[@]} )) || harnesses=(fuzz_safetensors fuzz_forward_request fuzz_http_infer)
build=build-fuzz

# -Wno-pass-failed: the sanitizers' checks keep clang from vectorizing the loop that
# core/dnnl_context.cc asks to with `#pragma omp simd`, and it says so ("loop not vectorized");
# speed is no aim of this build.
source deploy/build-env.sh
CC=clang-14 CXX=clang++-14 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_CXX_FLAGS="-Wno-pass-failed" \
  -DATTNSERVE_SANITIZE=fuzzer-no-link,address,undefined \
  -DATTNSERVE_BUILD_FUZZERS=ON -DATTNSERVE_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j"$build_jobs" --target "${harnesses[@]}"
python3 tests/fuzz/make_seeds.py "$build/seeds"
mkdir -p "$build/crashes"

# One compute thread: inputs run one at a time, and an OpenMP team per call would cost more
# than the tiny calls do. Leaks are checked (LSan); see tests/sanitizers/lsan.supp.
export OMP_NUM_THREADS=1
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0"
declare -A max_len=([fuzz_safetensors]=16384 [fuzz_forward_request]=8192 [fuzz_http_infer]=8192)
# The harnesses run side by side (the run takes SECONDS, not SECONDS per harness), each on its
# own corpus and log.
pids=()
for h in "${harnesses[@]}"; do
  corpus="$build/corpus/$h"
  mkdir -p "$corpus"
  echo "== $h: ${seconds}s"
  # -timeout=0: no per-input SIGALRM. Its handler (libFuzzer's AlarmCallback, each second) can
  # land while oneDNN's JIT code runs and then trips ASan on its own clock_gettime (seen on a
  # loaded machine, a report in libFuzzer, not in our code); -max_total_time still bounds the run.
  "$build/tests/fuzz/$h" "$corpus" "$build/seeds/$h" \
    -max_total_time="$seconds" -max_len="${max_len[$h]}" -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -timeout=0 -print_final_stats=1 \
    -artifact_prefix="$build/crashes/$h-" 2>"$build/$h.log" &
  pids+=($!)
done
status=0
for i in "${!harnesses[@]}"; do
  h="${harnesses[$i]}" failed=0
  wait "${pids[$i]}" || failed=1
  # The last progress line (execs, coverage, corpus) and the totals; the whole log on failure.
  echo "== $h"
  grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "$build/$h.log" | tail -1 || true
  grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$build/$h.log" || true
  if (( failed )); then tail -60 "$build/$h.log"; status=1; fi
done
exit "$status"
