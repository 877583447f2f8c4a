# Sourced by the scripts that build and test (deploy/build.sh, deploy/test.sh, tests/fuzz/run.sh,
# tests/sanitizers/run.sh): how every build tree is built and how its suites are run.

# Ninja for a new tree (it keeps every core busy where make's targets wait on each other); a tree
# configured before keeps its generator.
export CMAKE_GENERATOR="${CMAKE_GENERATOR:-Ninja}"
# One build job a core. nproc answers OMP_NUM_THREADS instead when it is set (the TSan run sets it
# to 1, and a server's environment may).
build_jobs="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"

# run_suites DIR EXCLUDED_LABELS [CTEST_ARGS...]: DIR's ctest suites, the engine's (label core,
# which time nothing) two at a time, then the others, which start servers and wait on them, one
# at a time; tests labelled to match the regex EXCLUDED_LABELS (may be empty) are left out.
# (One -LE regex: ctest leaves a test out only when it matches every -LE given.)
run_suites() {
  local dir=$1 excluded=$2
  shift 2
  ctest --test-dir "$dir" --output-on-failure -L core -j2 "$@"
  ctest --test-dir "$dir" --output-on-failure -LE "core${excluded:+|$excluded}" "$@"
}
