#!/usr/bin/env bash
# Installs what attnserve needs to build, test and serve on Debian 12 (bookworm), as root.
# Idempotent: packages already present are skipped, so a second run costs a second.
#   deploy/install-deps.sh [--test] [--torch] [--list]   (--help says what each adds)
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: deploy/install-deps.sh [--test] [--torch] [--list] [-h|--help]
Installs the Debian 12 packages attnserve needs (apt-get, as root or through sudo); packages
already installed are skipped.
  (no flag)   what building and serving need
  --test      also what the test suites run (deploy/test.sh)
  --torch     also PyTorch (golden fixtures, the PyTorch benchmark)
  --list      print the packages the other flags select, one a line, and install nothing
  -h, --help  this text
Flags combine: deploy/install-deps.sh --test --torch
USAGE
}
with_test=0 with_torch=0 list=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    --torch) with_torch=1 ;;
    --list) list=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "install-deps.sh: unknown argument '$arg'" >&2; usage >&2; exit 2 ;;
  esac
done

packages=(
  build-essential cmake ninja-build pkg-config  # Ninja: builds keep both cores busy
  libdnnl-dev ocl-icd-opencl-dev                # oneDNN 2.6 (OpenMP); its CMake config wants OpenCL
  libgrpc++-dev protobuf-compiler-grpc          # gRPC 1.51 + grpc_cpp_plugin, grpc_python_plugin
  libprotobuf-dev protobuf-compiler             # protobuf 3.21
  libabsl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libgtest-dev
  prometheus-cpp-dev                            # /metrics (prometheus-cpp 1.0 with civetweb)
  libcivetweb-dev libsimdjson-dev libssl-dev    # the REST port: civetweb 1.15, simdjson 3.0, its TLS
  python3 python3-grpcio python3-numpy          # the Python client example and its test
)
# What only the test suites need (deploy/test.sh); one group per suite.
test_packages=(
  openssl                                       # tests/server security suite, python example: certificates
  chromium                                      # client_bench_html: the load test's HTML report in a headless browser
  nginx                                         # deploy/scaleout-test.sh: nginx balancing gRPC (grpc_pass)
  nodejs npm                                    # client_node_example (client/node) and deploy_k8s_manifests; packages from the npm registry
  prometheus                                    # prometheus_scrape: a real Prometheus scrapes attnserve
  # tests/fuzz and tests/sanitizers: clang with libFuzzer and the sanitizer runtimes, the OpenMP
  # runtime clang links, llvm-symbolizer for readable reports
  clang-14 libclang-rt-14-dev libomp-14-dev llvm-14
  clang-format-14                               # deploy/check-format.sh (clang-14 does not bring it)
  curl libcurl4-openssl-dev                     # the REST port's tests: curl (README's example), libcurl (TLS calls)
  rapidjson-dev                                 # tests/bench/json_bench: the JSON parsers compared
)
(( with_test )) && packages+=("${test_packages[@]}")
# Debian's torch calls the system BLAS; without OpenBLAS that is netlib's reference BLAS (~1 GFLOP/s),
# which would make the PyTorch benchmark (tests/bench) meaningless. The OpenMP build matches torch's.
(( with_torch )) && packages+=(python3-torch libopenblas0-openmp)
if (( list )); then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" && continue
  # A NodeSource nodejs carries its own npm and conflicts with Debian's npm package.
  [[ "$p" == npm ]] && command -v npm >/dev/null && continue
  missing+=("$p")
done
if (( ${#missing[@]} )); then
  sudo=""; (( EUID == 0 )) || sudo="sudo"
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
