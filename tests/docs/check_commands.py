#!/usr/bin/python3
"""docs_commands: the shell blocks of README.md and docs/*.md run as written.

Every fenced block names its language. A shell block (sh, bash, shell, console, zsh) is either
marked runnable by an HTML comment on the line before its fence, or listed in UNRUNNABLE below
with the reason it cannot run in a test; anything else fails, so a new block is one or the other.

  <!-- runnable -->               the block runs on its own
  <!-- runnable: server -->       a test server runs first, on a free loopback port; the block's
                                  `localhost:50051` is that server: the text is replaced by its
                                  address, and attnserve-client and client/python/*.py called
                                  without --target are given it; `localhost:8000` (the REST
                                  port) is replaced by its REST port's address
  <!-- runnable: server FLAGS --> the same, the server started with FLAGS too (relative paths
                                  are read in the page's directory, see below)

The blocks of one page run in order, each with `bash -e -o pipefail`, in one temporary
directory that mirrors the repository's root: a symbolic link to each of its entries, and a
`build/` whose entries lead to the build under test. Paths under `/tmp/` are moved into that
directory's own `tmp/`, so nothing outside it is written.

    tests/docs/check_commands.py --source REPOSITORY_ROOT --build BUILD_DIR
"""
import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SHELLS = {"sh", "bash", "shell", "console", "zsh"}
MARKER = re.compile(r"^<!--\s*runnable(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
BLOCK_SECONDS = 30
SERVER_START_SECONDS = 30

# Shell blocks that cannot run in a test, by page and first line, with the reason. A block listed
# here that no longer exists fails the test too, so the list stays true.
UNRUNNABLE = {
    ("README.md", "# serve: installs the dependencies, builds into build/, serves the built-in demo layer"):
        "installs packages, builds, and the server runs until stopped; the test command runs everything",
    ("README.md", "deploy/docker-build.sh       # the image `attnserve` (docker, else podman)"):
        "needs podman or docker and the Debian images, then a Kubernetes cluster",
    ("README.md", "build/server/attnserve --model mha=/tmp/mha.safetensors"):
        "serves until stopped, and needs a file PyTorch wrote",
    ("docs/models.md", "build/server/attnserve --model mha=/tmp/mha.safetensors"):
        "serves until stopped, and needs a file PyTorch wrote",
    ("docs/clients.md", "mkdir -p /tmp/attnserve-node && cp client/node/package*.json /tmp/attnserve-node/"):
        "downloads packages from the npm registry (client_node_example tests the example)",
    ("docs/security.md", "build/server/attnserve --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem \\"):
        "serves until stopped; the next block runs against a server started with these flags",
    ("docs/deployment.md", "deploy/docker-build.sh                   # the image `attnserve`, with docker (else podman)"):
        "needs podman or docker and the Debian images",
    ("docs/deployment.md", "kubectl apply -f deploy/k8s/"):
        "needs a Kubernetes cluster",
    ("docs/deployment.md", "kubectl apply -f deploy/k8s/kserve/"):
        "needs a Kubernetes cluster with KServe",
    ("docs/load-testing.md", "build/client/attnserve-client bench --random 8,128 --kind causal --concurrency 4 --duration 10"):
        "a 10 s load test; the page's first block runs a short one",
    ("docs/load-testing.md", "build/client/attnserve-client bench --random 1,16 --rate 2000 --arrival poisson --duration 10"):
        "a 10 s load test",
    ("docs/load-testing.md", "build/client/attnserve-client bench --random 1,16 --rate-range 1000:8000:x2 --duration 2 --latency-limit-ms 50"):
        "a sweep of several seconds",
    ("docs/load-testing.md", "build/client/attnserve-client bench --random 1,16 --concurrency-range 1:32:x2 --duration 5"):
        "a sweep of half a minute",
    ("docs/load-testing.md", "build/client/attnserve-client bench --random 8,512 --lengths-uniform 32:512 \\"):
        "load tests of 15 s",
    ("docs/performance.md", "deploy/build.sh -DATTNSERVE_BUILD_TESTS=ON -DATTNSERVE_BUILD_BENCH=ON   # the benchmarks too"):
        "a build, then a benchmark of minutes; compare.sh needs PyTorch (bench_smoke runs two shapes)",
    ("docs/performance.md", "tests/bench/serving.py --reps 3 --seconds 3                  # the C++ client"):
        "a benchmark of minutes, and its baseline needs PyTorch",
    ("docs/performance.md", "OMP_NUM_THREADS=2 build/tests/bench/attnserve_decode_bench --sequences 64 --cached 512,4096"):
        "benchmarks of minutes over 1.6 GB of cache; decode.py's peer needs PyTorch "
        "(decode_bench_smoke runs a small decode benchmark)",
    ("docs/testing.md", "deploy/test.sh"):
        "the whole test command, of which this test is a part",
    ("docs/testing.md", "tests/fuzz/run.sh 30          # the libFuzzer harnesses side by side for 30 s (ASan + UBSan); what CI runs"):
        "builds of their own and runs of minutes; the test command runs them",
}


class Block:
    """A fenced code block of a page."""

    def __init__(self, page, line, language, marker, text):
        self.page, self.line, self.language, self.marker, self.text = page, line, language, marker, text
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        self.first_line = lines[0] if lines else ""

    def where(self):
        return f"{self.page}:{self.line}"


def pages(root):
    """README.md and every markdown file under docs/, as paths relative to the root."""
    found = ["README.md"]
    for folder, _, files in os.walk(os.path.join(root, "docs")):
        found += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files)
                  if f.endswith(".md")]
    return [p for p in found if os.path.isfile(os.path.join(root, p))]


def blocks(root, page):
    """Every fenced block of a page, with the runnable marker on the line before it, if any."""
    with open(os.path.join(root, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        previous = next((l.strip() for l in reversed(lines[:i]) if l.strip()), "")
        marker = MARKER.match(previous)
        start, i = i, i + 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and set(lines[i].strip()) == {fence[0]}):
            i += 1
        language = info.split()[0].lower() if info else ""
        found.append(Block(page, start + 1, language,
                           None if marker is None else (marker.group(1) or ""),
                           "\n".join(lines[start + 1:i])))
        i += 1
    return found


def classify(all_blocks):
    """(blocks to run, problems): every block is named, every shell block marked or listed."""
    to_run, problems, listed = [], [], set()
    for block in all_blocks:
        key = (block.page, block.first_line)
        if not block.language:
            problems.append(f"{block.where()}: a fenced block without a language: say sh, python, "
                            "text, ... after the fence")
        elif block.language not in SHELLS:
            if block.marker is not None:
                problems.append(f"{block.where()}: marked runnable, but a '{block.language}' block")
        elif block.marker is not None:
            if key in UNRUNNABLE:
                problems.append(f"{block.where()}: marked runnable and listed in UNRUNNABLE too")
            marker = block.marker.split()
            if marker and marker[0] != "server":
                problems.append(f"{block.where()}: unknown marker 'runnable: {block.marker}'")
            else:
                to_run.append(block)
        elif key in UNRUNNABLE:
            listed.add(key)
        else:
            problems.append(
                f"{block.where()}: a shell block neither marked runnable nor listed: put "
                f"'<!-- runnable -->' on the line before it, or add ({block.page!r}, "
                f"{block.first_line!r}) with a reason to UNRUNNABLE in {os.path.basename(__file__)}")
    for key in sorted(set(UNRUNNABLE) - listed):
        problems.append(f"UNRUNNABLE lists {key}, which is no shell block of that page any more")
    return to_run, problems


def mirror(root, build, directory):
    """A directory that looks like the repository's root, its build/ being the build under test."""
    for name in os.listdir(root):
        if name.startswith("build") or name == ".git":
            continue
        os.symlink(os.path.join(root, name), os.path.join(directory, name))
    os.mkdir(os.path.join(directory, "build"))
    for name in os.listdir(build):
        if name != "client":
            os.symlink(os.path.join(build, name), os.path.join(directory, "build", name))
    client = os.path.join(directory, "build", "client")
    os.mkdir(client)
    for name in os.listdir(os.path.join(build, "client")):
        if name != "attnserve-client":
            os.symlink(os.path.join(build, "client", name), os.path.join(client, name))
    # attnserve-client called without --target in a server block is given the test server's.
    wrapper = os.path.join(client, "attnserve-client")
    with open(wrapper, "w") as f:
        f.write(f"""#!/bin/sh
real='{os.path.join(build, "client", "attnserve-client")}'
if [ -n "${{ATTNSERVE_DOCS_TARGET:-}}" ]; then
  for a in "$@"; do case "$a" in --target|--target=*) exec "$real" "$@";; esac; done
  exec "$real" --target "$ATTNSERVE_DOCS_TARGET" "$@"
fi
exec "$real" "$@"
""")
    os.chmod(wrapper, 0o755)
    os.mkdir(os.path.join(directory, "tmp"))


class Servers:
    """Test servers of one page, one per set of extra flags, started when a block needs one."""

    def __init__(self, build, directory):
        self.build, self.directory, self.running = build, directory, {}

    def address(self, flags):
        """The server's gRPC address and its REST port's."""
        key = tuple(flags)
        if key not in self.running:
            self.running[key] = self.start(flags, len(self.running))
        return self.running[key][1]

    def start(self, flags, index):
        port_file = os.path.join(self.directory, f".server{index}.port")
        log = open(os.path.join(self.directory, f".server{index}.log"), "w")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            http = f"127.0.0.1:{s.getsockname()[1]}"
        command = [os.path.join(self.build, "server", "attnserve"), "--listen", "127.0.0.1:0",
                   "--port-file", port_file, "--metrics-listen", "off", "--http-listen", http,
                   *flags]
        process = subprocess.Popen(command, cwd=self.directory, stdout=log,
                                   stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline and process.poll() is None:
            if os.path.exists(port_file):
                with open(port_file) as f:
                    port = f.read().strip()
                if port:
                    return process, (f"127.0.0.1:{port.rsplit(':', 1)[-1]}", http)
            time.sleep(0.05)
        process.kill()
        process.wait()
        with open(log.name) as f:
            raise RuntimeError(f"the test server did not start: {' '.join(command)}\n{f.read()}")

    def stop(self):
        for process, _ in self.running.values():
            process.send_signal(signal.SIGTERM)
        for process, _ in self.running.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.running = {}


def script(block, directory, addresses):
    """The block as bash runs it: continuations joined, /tmp moved, the server's addresses in."""
    text = block.text.replace("\\\n", " ")
    text = re.sub(r"(?<![\w.-])/tmp/", os.path.join(directory, "tmp") + "/", text)
    if addresses is not None:
        address, http = addresses
        text = text.replace("localhost:50051", address).replace("localhost:8000", http)
        text = re.sub(r"(client/python/\w+\.py)(?![^\n]*--target)", rf"\1 --target {address}", text)
    return text


def run(block, directory, servers, build, verbose):
    """Runs one block; a message when it fails, else None."""
    env = dict(os.environ)
    env.pop("ATTNSERVE_TOKEN", None)
    env.pop("ATTNSERVE_DOCS_TARGET", None)
    env["ATTNSERVE_PY_STUBS"] = os.path.join(build, "python")
    addresses = None
    if block.marker:  # "server [FLAGS]"
        addresses = servers.address(block.marker.split()[1:])
        env["ATTNSERVE_DOCS_TARGET"] = addresses[0]
    text = script(block, directory, addresses)
    started = time.monotonic()
    try:
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=directory,
                                env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, timeout=BLOCK_SECONDS)
    except subprocess.TimeoutExpired as e:
        return f"{block.where()}: still running after {BLOCK_SECONDS} s:\n{text}\n{e.stdout or ''}{e.stderr or ''}"
    seconds = time.monotonic() - started
    print(f"{block.where()}: exit {result.returncode} in {seconds:.1f} s: {block.first_line}")
    if verbose:
        print(f"{result.stdout}{result.stderr}")
    if result.returncode != 0:
        return (f"{block.where()}: exit status {result.returncode}\n--- ran:\n{text}\n"
                f"--- stdout:\n{result.stdout}--- stderr:\n{result.stderr}")
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="the repository's root")
    parser.add_argument("--build", required=True, help="the build directory under test")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--verbose", action="store_true", help="print what every block printed")
    args = parser.parse_args()
    root, build = os.path.realpath(args.source), os.path.realpath(args.build)

    all_blocks = [b for page in pages(root) for b in blocks(root, page)]
    to_run, problems = classify(all_blocks)
    for name in ("server/attnserve", "client/attnserve-client"):
        if not os.access(os.path.join(build, name), os.X_OK):
            problems.append(f"no {os.path.join(build, name)}: build it first")
    if problems:
        print("\n".join(problems))
        return 1

    top = tempfile.mkdtemp(prefix="attnserve-docs-")
    failures = []
    try:
        for page in sorted({b.page for b in to_run}, key=[b.page for b in to_run].index):
            directory = os.path.join(top, page.replace("/", "_").removesuffix(".md"))
            os.mkdir(directory)
            mirror(root, build, directory)
            servers = Servers(build, directory)
            try:
                for block in (b for b in to_run if b.page == page):
                    failure = run(block, directory, servers, build, args.verbose)
                    if failure:
                        failures.append(failure)
                        break  # later blocks of the page may need what this one made
            except RuntimeError as e:
                failures.append(f"{page}: {e}")
            finally:
                servers.stop()
    finally:
        if args.keep:
            print(f"kept {top}")
        else:
            shutil.rmtree(top, ignore_errors=True)
    for failure in failures:
        print(failure)
    print(f"docs_commands: {len(all_blocks)} blocks, {len(to_run)} run, "
          f"{len(UNRUNNABLE)} listed as unrunnable, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
