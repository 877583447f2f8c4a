#!/usr/bin/env bash
# ctest driver (deploy_scripts): how the scripts a user runs first take their arguments, each
# run from a copy of itself in a scratch tree with stand-ins for what it calls (no package is
# installed, nothing of the project is built, no container engine runs):
#   deploy/install-deps.sh   flags combine, --help, an unknown flag exits 2 (through --list)
#   deploy/build.sh          serving only by default; -D... ON wins; the same build dir goes
#                            from one set to the other (real cmake, a project of no sources)
#   deploy/test.sh           formatting checked before the build, which asks for the tests
#   deploy/check-format.sh   lists a misformatted file and fails; passes a formatted tree
#   tests/bench/compare.sh   the build directory only when the first argument is not a flag
#   deploy/docker-*.sh       the same engine: $ENGINE, else docker when present, else podman
#   tests/deploy/scripts_test.sh SOURCE_DIR
set -euo pipefail
src=$(cd "${1:?usage: scripts_test.sh SOURCE_DIR}" && pwd)
work=$(mktemp -d /tmp/attnserve-scripts.XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
ok() { passed=$((passed + 1)); echo "ok: $*"; }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }
# expect NAME COMMAND...: COMMAND must succeed.
expect() { local name=$1; shift; if "$@"; then ok "$name"; else bad "$name"; fi; }
# run LOG COMMAND...: runs COMMAND, output to LOG; on failure prints LOG and counts a failure.
run() {
  local log=$1 code=0; shift
  "$@" >"$log" 2>&1 || code=$?
  (( code == 0 )) || { cat "$log"; bad "${*#"$work/"}: exit $code"; }
}

# tree NAME FILE...: a scratch checkout holding copies of FILE (paths relative to the source).
tree() {
  local t="$work/$1"; shift
  mkdir -p "$t"
  local f; for f in "$@"; do mkdir -p "$t/$(dirname "$f")"; cp -p "$src/$f" "$t/$f"; done
  echo "$t"
}
# stub FILE [BODY]: an executable that logs its name and arguments to $work/calls, then runs BODY.
stub() {
  mkdir -p "$(dirname "$1")"
  printf '#!/usr/bin/env bash\necho "%s $*" >>"%s/calls"\n%s\n' "$(basename "$1")" "$work" "${2:-}" >"$1"
  chmod +x "$1"
}
calls() { cat "$work/calls" 2>/dev/null || true; }

# --- deploy/install-deps.sh
deps=$src/deploy/install-deps.sh
code=0; out=$("$deps" --help) || code=$?
[[ $code == 0 && "$out" == usage:* ]] && ok "install-deps --help: usage, exit 0" ||
  bad "install-deps --help: exit $code, output: $out"
"$deps" -h >/dev/null && ok "install-deps -h: exit 0" || bad "install-deps -h: exit $?"
code=0; err=$("$deps" --test --bogus 2>&1 >/dev/null) || code=$?
[[ $code == 2 && "$err" == *"'--bogus'"* && "$err" == *usage:* ]] &&
  ok "install-deps --test --bogus: exit 2, names the flag, usage" ||
  bad "install-deps --test --bogus: exit $code: $err"
both=$("$deps" --test --torch --list) || bad "install-deps --test --torch --list: exit $?"
reversed=$("$deps" --list --torch --test)
plain=$("$deps" --list)
has() { grep -qx "$2" <<<"$1"; }
expect "install-deps --test --torch: test and torch packages together" \
  eval 'has "$both" chromium && has "$both" clang-format-14 && has "$both" python3-torch && has "$both" cmake'
expect "install-deps: flags in any order" test "$(sort <<<"$both")" == "$(sort <<<"$reversed")"
expect "install-deps with no flag: neither test nor torch packages" \
  eval '! has "$plain" chromium && ! has "$plain" python3-torch && has "$plain" cmake'

# --- deploy/build.sh, with real cmake on a project that only declares the two options
t=$(tree build deploy/build.sh deploy/build-env.sh)
stub "$t/deploy/install-deps.sh"
cat >"$t/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(options_only LANGUAGES NONE)
option(ATTNSERVE_BUILD_TESTS "" ON)
option(ATTNSERVE_BUILD_BENCH "" ON)
EOF
options() { grep -E '^ATTNSERVE_BUILD_(TESTS|BENCH):' "$t/build/CMakeCache.txt" | sort | tr '\n' ' '; }
off="ATTNSERVE_BUILD_BENCH:BOOL=OFF ATTNSERVE_BUILD_TESTS:BOOL=OFF "
on="ATTNSERVE_BUILD_BENCH:BOOL=ON ATTNSERVE_BUILD_TESTS:BOOL=ON "
run "$work/build.log" "$t/deploy/build.sh"
expect "build.sh: tests and benchmark off by default" test "$(options)" == "$off"
run "$work/build.log" "$t/deploy/build.sh" -DATTNSERVE_BUILD_TESTS=ON -DATTNSERVE_BUILD_BENCH=ON
expect "build.sh -D...=ON: on, re-configuring the same build dir" test "$(options)" == "$on"
run "$work/build.log" "$t/deploy/build.sh"
expect "build.sh again: off again" test "$(options)" == "$off"

# --- deploy/test.sh: the order of its steps, each a stand-in
t=$(tree test deploy/test.sh deploy/build-env.sh)
for s in deploy/install-deps.sh deploy/build.sh deploy/scaleout-test.sh tests/fuzz/run.sh \
         tests/sanitizers/run.sh; do stub "$t/$s"; done
stub "$t/deploy/check-format.sh" '[[ -z "${FORMAT_FAILS:-}" ]]'
stub "$work/bin/ctest"
rm -f "$work/calls"
run "$work/test.log" env PATH="$work/bin:$PATH" "$t/deploy/test.sh"
# (Not the sanitizer builds that test.sh starts in the background: they run when they run.)
steps=$(calls | grep -v -- --build-only | awk '{print $1}' | tr '\n' ' ')
expect "test.sh: install, format check, build, ctest, in that order" \
  eval '[[ "$steps" == "install-deps.sh check-format.sh build.sh ctest "* ]]'
expect "test.sh: build.sh asks for the tests and the benchmark" \
  eval 'calls | grep -q "^build.sh .*-DATTNSERVE_BUILD_TESTS=ON" && calls | grep -q "^build.sh .*-DATTNSERVE_BUILD_BENCH=ON"'
rm -f "$work/calls"
code=0; FORMAT_FAILS=1 PATH="$work/bin:$PATH" "$t/deploy/test.sh" >/dev/null 2>&1 || code=$?
expect "test.sh: a format failure stops it before the build" \
  eval '(( code != 0 )) && ! calls | grep -q "^build.sh"'

# --- deploy/check-format.sh, in a git repository of two files
if command -v clang-format-14 >/dev/null; then
  t=$(tree format deploy/check-format.sh .clang-format)
  printf 'int Good(int a) { return a + 1; }\n' >"$t/good.cc"
  printf 'int   Bad( int a ){return a+1;}\n' >"$t/bad.h"
  git -C "$t" init -q && git -C "$t" add . &&
    git -C "$t" -c user.name=t -c user.email=t@t commit -qm t
  code=0; out=$("$t/deploy/check-format.sh" 2>&1) || code=$?
  expect "check-format.sh: exit 1 listing the misformatted file only" \
    eval '(( code == 1 )) && grep -qx "  bad.h" <<<"$out" && ! grep -q "good.cc" <<<"$out"'
  clang-format-14 -i --style=file "$t/bad.h"
  expect "check-format.sh: exit 0 once formatted" eval '"$t/deploy/check-format.sh" >/dev/null 2>&1'
else
  bad "check-format.sh: no clang-format-14 (deploy/install-deps.sh --test installs it)"
fi

# --- tests/bench/compare.sh: the benchmarks are stand-ins that log their arguments
t=$(tree compare tests/bench/compare.sh)
json='{"shape": "small", "tokens": 8, "ms": 1.0, "efficiency": 0.5}'
cat >"$t/tests/bench/pytorch_bench.py" <<EOF
import sys
open("$work/calls", "a").write("pytorch_bench.py " + " ".join(sys.argv[1:]) + "\\n")
print('$json')
EOF
stub "$t/build/tests/bench/attnserve_bench" "echo '$json'"
stub "$work/other/tests/bench/attnserve_bench" "echo '$json'"
rm -f "$work/calls"
run "$work/compare.log" "$t/tests/bench/compare.sh" --shapes bert,small
expect "compare.sh --shapes X: the default build dir, --shapes to both benchmarks" \
  test "$(calls)" == "attnserve_bench --shapes bert,small --threads 2
pytorch_bench.py --shapes bert,small --threads 2"
rm -f "$work/calls"
run "$work/compare.log" "$t/tests/bench/compare.sh" "$work/other" --threads=3
expect "compare.sh DIR --threads=3: that build dir, its threads only" \
  test "$(calls)" == "attnserve_bench --threads=3
pytorch_bench.py --threads=3"
code=0; "$t/tests/bench/compare.sh" "$work/none" --shapes x >/dev/null 2>&1 || code=$?
expect "compare.sh MISSING-DIR: exit 2" test "$code" == 2

# --- deploy/docker-build.sh and docker-smoke.sh: which engine, with only stand-in engines on PATH
t=$(tree engine deploy/docker-build.sh deploy/docker-smoke.sh)
stub "$t/build/client/attnserve-client"
mkdir -p "$work/sys"
for tool in bash env dirname cat grep awk seq sleep tail mktemp rm tar git; do
  p=$(command -v "$tool") && ln -sf "$p" "$work/sys/$tool"
done
engine_body='case "$1" in
  --version) echo "$(basename "$0") version 1" ;;
  image) [[ "$*" == *--format* ]] && echo 1000000 || exit 1 ;;
  inspect) echo 0 ;;
  exec) echo 10001 ;;
esac'
# engine_of SCRIPT ENGINES...: the engine SCRIPT called, with only ENGINES on PATH.
engine_of() {
  local script=$1; shift
  rm -rf "$work/engines" "$work/calls"
  local e; for e in "$@"; do stub "$work/engines/$e" "$engine_body"; done
  mkdir -p "$work/engines"
  local code=0
  PATH="$work/engines:$work/sys" SKIP_BUILD=1 "$t/deploy/$script" >"$work/engine.log" 2>&1 || code=$?
  (( code == 0 )) || { cat "$work/engine.log" >&2; echo "$script exited $code" >&2; }
  calls | awk '$1 == "docker" || $1 == "podman" {print $1}' | sort -u | tr '\n' ' '
}
for script in docker-build.sh docker-smoke.sh; do
  expect "$script: docker and podman present: docker" test "$(engine_of $script docker podman)" == "docker "
  expect "$script: only podman: podman" test "$(engine_of $script podman)" == "podman "
  expect "$script: only docker: docker" test "$(engine_of $script docker)" == "docker "
  expect "$script: ENGINE=podman wins" test "$(ENGINE=podman engine_of $script docker podman)" == "podman "
done
expect "docker-build.sh with podman: the docker image format (keeps HEALTHCHECK)" \
  eval 'engine_of docker-build.sh podman >/dev/null; calls | grep -q "^podman build .*--format docker"'

echo "$passed passed, $failed failed"
(( failed == 0 ))
