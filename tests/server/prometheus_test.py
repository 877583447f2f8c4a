#!/usr/bin/env python3
"""A real Prometheus (Debian's `prometheus`) scrapes a real attnserve on loopback; PromQL over
Prometheus's HTTP API must then return the series the calls made.

  prometheus_test.py ATTNSERVE ATTNSERVE_CLIENT

Calls, each an `attnserve-client infer` whose exit status is checked: 12 Forward calls (1x16,
bidirectional, demo layer) and 3 for a model the server does not have; then 12 more once
Prometheus holds the series, since a rate needs growth between scrapes. Expected:
  attnserve_requests_total{code="OK"}        one series {model="demo", kind="bidirectional",
                                             protocol="grpc"}: 12
  attnserve_requests_total{code="NOT_FOUND"} one series {model="", kind=""}: 3
  attnserve_tokens_total                     12 * 16
  then attnserve_requests_total{code="OK"} 24, and its rate(...[1m]) one series > 0
  up{job="attnserve"}                        1
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import struct
import urllib.request

OK_CALLS = 12
NOT_FOUND_CALLS = 3
TOKENS = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_npy(path, shape):
    """A float32 .npy of ones (format 1.0), without needing numpy."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple(shape)}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    count = 1
    for d in shape:
        count *= d
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack(f"<{count}f", *([1.0] * count)))


def wait_for(what, check, timeout=60):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.5)
    sys.exit(f"FAIL: timed out waiting for {what} (last: {last!r})")


def query(prom_port, promql):
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = json.load(reply)
    except OSError:
        return None
    if body.get("status") != "success":
        sys.exit(f"FAIL: {promql}: {body}")
    return body["data"]["result"]


def one_series(prom_port, promql, value_ok):
    """Waits until `promql` returns exactly one series whose value satisfies `value_ok`."""
    def check():
        result = query(prom_port, promql)
        if result and len(result) == 1 and value_ok(float(result[0]["value"][1])):
            return result[0]
        return None
    return wait_for(f"{promql} (one series)", check)


def infer(client_bin, target, model, npy, out):
    """One Forward call from the bundled client; its exit status (the gRPC code)."""
    return subprocess.run([client_bin, "--target", target, "infer", "--model", model,
                           "--input", npy, "--output", out], capture_output=True).returncode


def ok_calls(client_bin, target, npy, out):
    for _ in range(OK_CALLS):
        code = infer(client_bin, target, "demo", npy, out)
        if code != 0:
            sys.exit(f"FAIL: a Forward call exited {code}")


def main():
    server_bin, client_bin = sys.argv[1], sys.argv[2]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.exit("FAIL: prometheus is not installed (deploy/install-deps.sh --test installs it)")
    work = tempfile.mkdtemp(prefix="attnserve-prometheus-")
    procs = []
    try:
        metrics_port = free_port()
        port_file = os.path.join(work, "port")
        server_log = open(os.path.join(work, "server.log"), "w")
        procs.append(subprocess.Popen(
            [server_bin, "--listen", "127.0.0.1:0", "--port-file", port_file, "--threads", "2",
             "--metrics-listen", f"127.0.0.1:{metrics_port}", "--log-format", "json"],
            stdout=server_log, stderr=subprocess.STDOUT))
        wait_for("attnserve's port file",
                 lambda: os.path.exists(port_file) and open(port_file).read().endswith("\n"))
        target = "127.0.0.1:" + open(port_file).read().strip()

        prom_port = free_port()
        config = os.path.join(work, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "scrape_configs:\n"
                    "  - job_name: attnserve\n"
                    f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
        prom_log = open(os.path.join(work, "prometheus.log"), "w")
        procs.append(subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work}/data",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=prom_log, stderr=subprocess.STDOUT))

        npy = os.path.join(work, "input.npy")
        out = os.path.join(work, "output.npy")
        write_npy(npy, (1, TOKENS, 256))
        ok_calls(client_bin, target, npy, out)
        for _ in range(NOT_FOUND_CALLS):
            code = infer(client_bin, target, "nope", npy, out)
            if code != 5:  # NOT_FOUND
                sys.exit(f"FAIL: a call for a missing model exited {code}")

        one_series(prom_port, 'up{job="attnserve"}', lambda v: v == 1)
        ok = one_series(prom_port, 'attnserve_requests_total{code="OK"}', lambda v: v == OK_CALLS)
        labels = {k: v for k, v in ok["metric"].items() if k not in ("instance", "job")}
        if labels != {"__name__": "attnserve_requests_total", "model": "demo",
                      "kind": "bidirectional", "code": "OK", "protocol": "grpc"}:
            sys.exit(f"FAIL: OK series labels {labels}")
        missing = one_series(prom_port, 'attnserve_requests_total{code="NOT_FOUND"}',
                             lambda v: v == NOT_FOUND_CALLS)
        if missing["metric"].get("model", "") != "" or missing["metric"].get("kind", "") != "":
            sys.exit(f"FAIL: a missing model became a label: {missing['metric']}")
        one_series(prom_port, 'attnserve_tokens_total', lambda v: v == OK_CALLS * TOKENS)
        # A rate needs the counter to grow between two scrapes: more calls, after the first.
        ok_calls(client_bin, target, npy, out)
        one_series(prom_port, 'attnserve_requests_total{code="OK"}', lambda v: v == 2 * OK_CALLS)
        one_series(prom_port, 'rate(attnserve_requests_total{code="OK"}[1m])', lambda v: v > 0)
        one_series(prom_port, 'sum(attnserve_request_duration_seconds_count)',
                   lambda v: v == 2 * OK_CALLS + NOT_FOUND_CALLS)
        one_series(prom_port, 'process_resident_memory_bytes', lambda v: v > 0)
        print("OK: Prometheus scraped attnserve and PromQL returned the expected series")
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if os.environ.get("KEEP_TEST_DIR"):
            print("kept", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
