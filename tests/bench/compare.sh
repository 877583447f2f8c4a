#!/usr/bin/env bash
# Runs attnserve_bench and tests/bench/pytorch_bench.py on the same shapes and threads, one after
# the other, and prints ours beside PyTorch's: time ratio (PyTorch / ours: > 1 means we are
# faster) and each one's efficiency against its own run's 4096^3 matmul peak.
#   tests/bench/compare.sh [build-dir] [--shapes ...] [--threads N] [--reps N] [--precision p]
# The build directory (default: build/ of this checkout) is the first argument when it is not a
# flag; every flag goes to both benchmarks, --threads 2 unless one is given.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="$here/../../build"
if [[ $# -gt 0 && "$1" != -* ]]; then
  build=$1
  shift
fi
args=("$@")
threads_given=0
for arg in "${args[@]}"; do
  case "$arg" in
    -h | --help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    --threads | --threads=*) threads_given=1 ;;
  esac
done
(( threads_given )) || args+=(--threads 2)
bench="$build/tests/bench/attnserve_bench"
[[ -x "$bench" ]] || { echo "no $bench: build the attnserve_bench target first" >&2; exit 2; }

echo "load before: $(uptime)"
ours="$("$bench" "${args[@]}")"
theirs="$(/usr/bin/python3 "$here/pytorch_bench.py" "${args[@]}")"
echo "load after:  $(uptime)"
echo "== attnserve_bench"; echo "$ours"
echo "== pytorch_bench.py"; echo "$theirs"
echo
/usr/bin/python3 - "$ours" "$theirs" <<'PY'
import json, sys
load = lambda text: {j["shape"]: j for j in (json.loads(l) for l in text.splitlines() if l.startswith("{"))}
ours, theirs = load(sys.argv[1]), load(sys.argv[2])
print(f"{'shape':8} {'tokens':>7} {'ours ms':>10} {'torch ms':>10} {'torch/ours':>10} {'our eff':>8} {'torch eff':>9}")
for name, o in ours.items():
    t = theirs.get(name)
    if t is None:
        continue
    if t["tokens"] != o["tokens"]:
        print(f"{name}: token counts differ ({o['tokens']} vs {t['tokens']}): shapes out of sync")
        sys.exit(1)
    print(f"{name:8} {o['tokens']:7} {o['ms']:10.3f} {t['ms']:10.3f} {t['ms'] / o['ms']:10.2f} "
          f"{o['efficiency']:8.3f} {t['efficiency']:9.3f}")
PY
