#!/usr/bin/python3
"""The REST port's benchmark against its targets, one server, one run, ratios:

  JSON 1x16 infer      server CPU per call / gRPC Forward 1x16's       target <= 2
  binary 1x128 infer   server CPU per call / gRPC Forward 1x128's      target <= 1.2
  GET /v2/health/ready calls/s / gRPC health Check's calls/s           target >= 1
  1,000 idle and slow connections held open: the JSON load's p99 beside them / without them
                       (target <= 2), and the server's resident memory with them.

Batching is off (--max-batch-tokens 0) so a call's CPU is its own. gRPC load is serving_load
(the serving benchmark's generic-stub client), REST load is http_load (raw keep-alive sockets);
both read the server's CPU from /proc/PID/stat. Run by hand (not by ctest):

  tests/bench/http_bench.py [--build build] [--seconds 4] [--callers 4]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listening on {port}")


def run(argv):
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build")
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--callers", type=int, default=4)
    args = parser.parse_args()
    build = os.path.abspath(args.build)
    grpc_port, http_port = free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="http-bench-", suffix=".log", delete=False)
    server = subprocess.Popen(
        [f"{build}/server/attnserve", "--listen", f"127.0.0.1:{grpc_port}", "--http-listen",
         f"127.0.0.1:{http_port}", "--metrics-listen", "off", "--max-batch-tokens", "0",
         "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(grpc_port)
        wait_listening(http_port)
        time.sleep(0.5)
        grpc = lambda method, **kw: run(
            [f"{build}/tests/bench/serving_load", "--target", f"127.0.0.1:{grpc_port}", "--pid",
             str(server.pid), "--method", method, "--seconds", str(args.seconds)] +
            [f"--{k}={v}" for k, v in kw.items()])
        rest = lambda method, **kw: run(
            [f"{build}/tests/bench/http_load", "--port", str(http_port), "--pid", str(server.pid),
             "--method", method, "--seconds", str(args.seconds)] +
            [f"--{k}={v}" for k, v in kw.items()])
        c = args.callers
        rows = {
            "grpc Forward 1x16": grpc("forward", batch=1, seq=16, callers=c),
            "REST JSON 1x16": rest("json", batch=1, seq=16, callers=c),
            "grpc Forward 1x128": grpc("forward", batch=1, seq=128, callers=c),
            "REST binary 1x128": rest("binary", batch=1, seq=128, callers=c),
            "grpc health Check": grpc("health", callers=8),
            "REST GET /v2/health/ready": rest("health", callers=8),
            "REST JSON 1x16, alone": rest("json", batch=1, seq=16, callers=c),
            "REST JSON 1x16, +500 idle +500 slow": rest("json", batch=1, seq=16, callers=c,
                                                        idle=500, slow=500),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"{'run':38} {'calls/s':>9} {'cpu us/call':>12} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'statuses':>20}")
    for name, r in rows.items():
        codes = r.get("codes", r.get("statuses"))
        print(f"{name:38} {r['calls_per_s']:9.0f} {r['server_cpu_us_per_call']:12.1f} "
              f"{r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {json.dumps(codes):>20}")
    cpu = lambda name: rows[name]["server_cpu_us_per_call"]
    ratios = [
        ("JSON 1x16 CPU / gRPC Forward 1x16", cpu("REST JSON 1x16") / cpu("grpc Forward 1x16"),
         "<= 2"),
        ("binary 1x128 CPU / gRPC Forward 1x128",
         cpu("REST binary 1x128") / cpu("grpc Forward 1x128"), "<= 1.2"),
        ("health calls/s REST / gRPC", rows["REST GET /v2/health/ready"]["calls_per_s"] /
         rows["grpc health Check"]["calls_per_s"], ">= 1"),
        ("p99 with 1,000 idle+slow / alone",
         rows["REST JSON 1x16, +500 idle +500 slow"]["p99_ms"] /
         rows["REST JSON 1x16, alone"]["p99_ms"], "<= 2"),
    ]
    print()
    for name, value, target in ratios:
        print(f"{name:44} {value:6.2f}   target {target}")
    print(f"{'server RSS with 1,000 idle+slow (MiB)':44} "
          f"{rows['REST JSON 1x16, +500 idle +500 slow']['server_rss_mib']:6.0f}   "
          f"(alone: {rows['REST JSON 1x16, alone']['server_rss_mib']:.0f})")


if __name__ == "__main__":
    sys.exit(main())
