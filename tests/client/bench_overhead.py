#!/usr/bin/python3
"""How much the load tester itself costs, against a real attnserve on loopback (1x16 calls, the
demo layer): the tester's CPU per call (its rusage, the same utime+stime /proc/PID/stat holds)
against the server's (from /proc/PID/stat), and whether it keeps the offered rate (within 2 %)
in an open loop at twice what the server answers. Prints the figures; exit 1 when the tester
costs more CPU per call than the server, or falls more than 2 % behind the offered rate.

With two or more CPUs the server gets the first (and --threads 1) and the tester the others, as
a tester runs on a machine of its own in a real test: sharing the cores, an overloaded server
would take the tester's CPU and the figure would measure the scheduler, not the tester.
--shared runs both on every CPU instead."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def pinned(cpus):
    """A preexec_fn running the child on `cpus` (None: wherever the scheduler likes)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def start_server(binary, workdir, cpus):
    port_file = os.path.join(workdir, "port")
    threads = str(len(cpus)) if cpus else "2"
    server = subprocess.Popen([binary, "--listen", "127.0.0.1:0", "--port-file", port_file,
                               "--threads", threads, "--log-level", "warn",
                               "--metrics-listen=off"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=pinned(cpus))
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(port_file) and open(port_file).read().endswith("\n"):
            return server, f"127.0.0.1:{open(port_file).read().strip()}"
        time.sleep(0.05)
    server.kill()
    sys.exit("attnserve wrote no port")


def bench(client, target, server_pid, args, cpus):
    """Runs one bench; returns its JSON report, its own CPU seconds and the server's."""
    server_before = cpu_seconds(server_pid)
    proc = subprocess.Popen([client, "--target", target, "bench", "--random", "1,16", "--json",
                             "--warmup-seconds", "0"] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pinned(cpus))
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    server_cpu = cpu_seconds(server_pid) - server_before
    if proc.returncode not in (0, 8):  # RESOURCE_EXHAUSTED: refusals past capacity
        sys.exit(f"bench {args} exited {proc.returncode}: {proc.stderr.read()}")
    return json.loads(out), usage.ru_utime + usage.ru_stime, server_cpu


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--seconds", type=float, default=2)
    parser.add_argument("--shared", action="store_true",
                        help="server and tester on every CPU (default: a CPU for the server)")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = tester_cpus = None
    if len(cpus) >= 2 and not args.shared:
        server_cpus, tester_cpus = {cpus[0]}, set(cpus[1:])
        print(f"server on CPU {cpus[0]} (--threads 1), tester on CPUs {sorted(tester_cpus)}")
    else:
        print(f"server and tester share CPUs {cpus}")
    workdir = tempfile.mkdtemp(prefix="attnserve-overhead-")
    server, target = start_server(args.server, workdir, server_cpus)
    failures = []
    try:
        # CPU per call: 16 calls in flight, the server busy. The marginal cost between a run
        # and one twice as long, so the tester's start (gRPC, the request) is not counted.
        runs = [bench(args.client, target, server.pid,
                      ["--concurrency", "16", "--duration", str(d)], tester_cpus)
                for d in (args.seconds / 2, args.seconds)]
        calls = runs[1][0]["sent"] - runs[0][0]["sent"]
        per_call_client = (runs[1][1] - runs[0][1]) / calls * 1e6
        per_call_server = (runs[1][2] - runs[0][2]) / calls * 1e6
        print(f"closed loop c=16, 1x16: {runs[1][0]['requests_per_second']:.0f} calls/s; "
              f"CPU per call over {calls} calls: "
              f"tester {per_call_client:.1f} us, server {per_call_server:.1f} us "
              f"(ratio {per_call_client / per_call_server:.2f})")
        if per_call_client >= per_call_server:
            failures.append("the tester costs more CPU per call than the server")
        # What the server answers at most: 64 calls in flight over 4 connections keep its
        # batches full and its transport threads busy.
        capacity = bench(args.client, target, server.pid,
                         ["--concurrency", "64", "--connections", "4",
                          "--duration", str(args.seconds)], tester_cpus)[0]["requests_per_second"]
        print(f"capacity (closed loop c=64 over 4 connections): {capacity:.0f} calls/s")
        # The open loop at twice what the server answers: the tester must still send on time.
        rate = round(2 * capacity)
        report, client_cpu, server_cpu = bench(
            args.client, target, server.pid,
            ["--rate", str(rate), "--duration", str(args.seconds), "--max-in-flight", "100000",
             "--connections", "4"], tester_cpus)
        achieved = report["achieved_rate"]
        print(f"open loop at 2x capacity: offered {rate}/s, achieved {achieved:.0f}/s "
              f"({100 * (achieved / rate - 1):+.2f} %), sent {report['sent']} of "
              f"{report['scheduled']}, late {report['late']}, send lag p99 "
              f"{report['send_lag_ms']['p99']:.2f} ms; answered {report['requests_per_second']:.0f}/s, "
              f"{report['ok']} ok, errors {report['errors']}; tester CPU {client_cpu:.2f} s")
        if abs(achieved / rate - 1) > 0.02 or report["unsent"] > 0:
            failures.append("the tester fell more than 2 % behind the offered rate")
    finally:
        server.terminate()
        server.wait(timeout=30)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
