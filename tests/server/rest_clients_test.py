#!/usr/bin/python3
"""rest_clients: clients nobody here wrote call the REST port of a real attnserve: Debian's curl
runs README.md's REST example exactly as written (its `localhost:8000` pointed at the test
server), then client/python/rest_example.py (standard library only) calls it.

    rest_clients_test.py ATTNSERVE_BINARY REPOSITORY_ROOT
"""
import os
import re
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_curl_block(root):
    """The README's shell block that calls the REST port."""
    text = open(os.path.join(root, "README.md")).read()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        if "localhost:8000" in block and "curl" in block:
            return block
    sys.exit("README.md has no curl block for localhost:8000")


def main():
    binary, root = sys.argv[1], sys.argv[2]
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="rest-clients-", suffix=".log", delete=False)
    server = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--metrics-listen", "off",
                               "--http-listen", f"127.0.0.1:{port}"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        block = readme_curl_block(root).replace("localhost:8000", f"127.0.0.1:{port}")
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block],
                                capture_output=True, text=True, timeout=60)
        print(result.stdout, result.stderr)
        if result.returncode != 0 or '"outputs"' not in result.stdout or \
                '{"ready":true}' not in result.stdout:
            return f"the README's curl example failed (exit {result.returncode})"
        example = subprocess.run(
            [sys.executable, os.path.join(root, "client/python/rest_example.py"), "--url",
             f"http://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
        print(example.stdout, example.stderr)
        if example.returncode != 0:
            return f"client/python/rest_example.py failed (exit {example.returncode})"
        return 0
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
