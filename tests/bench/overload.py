#!/usr/bin/python3
"""The overload benchmark: what a server keeps of its capacity when callers send more than it
can serve, every call with a deadline. One run, ratios printed. Run by hand (not by ctest):

  tests/bench/overload.py [--build build] [--seconds 10] [--deadline 1] [--server-args "..."]

1. Capacity: a closed loop (8 calls in flight, 4x256 calls on the demo layer), ok calls/s.
2. For 1 and 4 connections, open loops (Poisson arrivals) at 1.5x and 3x that capacity, each call
   with a deadline (1 s): ok calls/s / capacity, and the server's own figures over the window:
   compute spent on calls answered after their deadline / all compute (late compute), calls shed
   by reason. Every call sent must be answered once (sent = ok + failed).
3. A mix: small (1x16) and large (4x256) calls from two load testers at once, each offering half
   of the load's calls; the small calls' ok share beside their share of the offer.
Server and load tester share the machine's cores, as a sidecar would.
"""
import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url):
    """The server's counters: {series: value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def delta(after, before, pattern):
    return sum(v - before.get(k, 0.0) for k, v in after.items() if re.fullmatch(pattern, k))


def bench(client, target, deadline, args):
    cmd = [client, "--target", target, "--no-retry", "--timeout", str(deadline), "bench", "--json"]
    cmd += args
    result = subprocess.run(cmd, capture_output=True, text=True)
    if not result.stdout.strip():
        sys.exit("load tester failed: " + result.stderr)
    return json.loads(result.stdout)


def summary(report):
    """The (last) step of a report: ok, sent, errors by code, elapsed_seconds."""
    return report["steps"][-1] if report.get("steps") else report


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", default=os.path.join(root, "build"))
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--server-args", default="")
    opts = parser.parse_args()
    server_bin = os.path.join(opts.build, "server", "attnserve")
    client = os.path.join(opts.build, "client", "attnserve-client")
    port, mport = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    murl = f"http://127.0.0.1:{mport}/metrics"
    log = tempfile.NamedTemporaryFile(prefix="overload-", suffix=".log", delete=False)
    server = subprocess.Popen([server_bin, "--listen", target, "--metrics-listen",
                               f"127.0.0.1:{mport}", "--log-level", "warn"] +
                              shlex.split(opts.server_args), stdout=log, stderr=log)
    try:
        for _ in range(100):
            if subprocess.run([client, "--target", target, "health"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        large = ["--random", "4,256"]
        closed = bench(client, target, 0, large + ["--concurrency", "8", "--duration",
                                                    str(opts.seconds)])
        step = summary(closed)
        capacity = step["ok"] / step["elapsed_seconds"]
        print(f"capacity (closed loop, 8 in flight, 4x256): {capacity:.1f} ok calls/s")
        print(f"{'load':>6} {'conns':>5} {'sent/s':>7} {'ok/s':>7} {'ok/cap':>7} "
              f"{'late/compute':>12} {'answered':>9}  shed by reason")
        for connections in (1, 4):
            for factor in (1.5, 3.0):
                before = metrics(murl)
                report = bench(client, target, opts.deadline, large + [
                    "--rate", str(factor * capacity), "--arrival", "poisson", "--connections",
                    str(connections), "--duration", str(opts.seconds), "--warmup-seconds", "0"])
                time.sleep(opts.deadline + 0.5)  # answers of the last calls are counted
                after = metrics(murl)
                s = summary(report)
                ok = s["ok"] / s["elapsed_seconds"]
                compute = delta(after, before, r'attnserve_compute_duration_seconds_sum\{.*\}')
                late = delta(after, before, r'attnserve_late_compute_seconds_total\{.*\}')
                shed = {re.search(r'reason="(\w+)"', k).group(1): int(v - before.get(k, 0))
                        for k, v in after.items() if k.startswith("attnserve_shed_total")}
                answered = s["ok"] + sum(s["errors"].values()) == s["sent"]
                print(f"{factor:>5}x {connections:>5} {s['sent'] / s['elapsed_seconds']:>7.1f} "
                      f"{ok:>7.1f} {ok / capacity:>7.2f} {late / max(compute, 1e-9):>12.3f} "
                      f"{'yes' if answered else 'NO':>9}  "
                      + ", ".join(f"{k} {v}" for k, v in sorted(shed.items()) if v))
        print("mix: small 1x16 and large 4x256 calls, half of the calls each")
        small_cost = 16.0 / 1024  # a small call's tokens against a large one's
        for factor in (1.5, 3.0):
            # Offered work = factor x capacity: each stream offers r calls/s.
            r = factor * capacity / (1 + small_cost)
            procs = []
            for shape in ("1,16", "4,256"):
                cmd = [client, "--target", target, "--no-retry", "--timeout", str(opts.deadline),
                       "bench", "--json", "--random", shape, "--rate", str(r), "--arrival",
                       "poisson", "--duration", str(opts.seconds), "--warmup-seconds", "0"]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
            small, big = (summary(json.loads(p.communicate()[0])) for p in procs)
            small_share = small["ok"] / max(small["sent"], 1)
            big_share = big["ok"] / max(big["sent"], 1)
            print(f"{factor:>5}x  small ok {small['ok'] / small['elapsed_seconds']:.1f}/s "
                  f"({small_share:.2f} of sent), large ok {big['ok'] / big['elapsed_seconds']:.1f}/s "
                  f"({big_share:.2f} of sent); work ok / capacity "
                  f"{(big['ok'] + small_cost * small['ok']) / big['elapsed_seconds'] / capacity:.2f}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
