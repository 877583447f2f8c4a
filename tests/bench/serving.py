#!/usr/bin/python3
"""The serving benchmark: attnserve against gRPC's own floor and a Python grpcio + PyTorch
baseline (baseline_server.py), all driven by the same client on this machine, one after the
other, medians over repetitions. Prints a table of calls/s and server CPU per call, and the
ratios the serving targets ask for. Run by hand (not by ctest):

  tests/bench/serving.py [--build build] [--reps 3] [--seconds 3] [--no-baseline]
                         [--client cpp|python] [--server-args "--metrics-listen ..."]

The client is serving_load (C++, gRPC's generic stub: the cheapest gRPC client there is, so
the floor is gRPC's server alone) or, with --client python, serving_load.py (grpcio, the
client the first serving measurements used; its floor includes what a slower client costs
the server per call).

Needs the build (attnserve, serving_load, build/python stubs for the baseline) and, for the
baseline, PyTorch (deploy/install-deps.sh --torch).
"""
import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listening on {port}")


class Server:
    def __init__(self, name, argv, port, metrics_port=None):
        self.name, self.port, self.metrics_port = name, port, metrics_port
        self.log = tempfile.NamedTemporaryFile(prefix=f"serving-{name}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        wait_healthy(port)
        time.sleep(0.5)

    def compute_totals(self):
        """The server's own compute seconds and computed calls so far (its /metrics), or None."""
        if self.metrics_port is None:
            return None
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics").read()
        totals = {"seconds": 0.0, "calls": 0.0}
        for line in text.decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name == "attnserve_compute_duration_seconds_sum":
                totals["seconds"] += float(line.rsplit(" ", 1)[1])
            elif name == "attnserve_batch_calls_sum":
                totals["calls"] += float(line.rsplit(" ", 1)[1])
        return totals

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_once(args, server, method="forward", batch=1, seq=16, callers=8):
    if args.client == "python":
        load = ["/usr/bin/python3", os.path.join(HERE, "serving_load.py"),
                "--stubs", os.path.join(args.build, "python")]
    else:
        load = [os.path.join(args.build, "tests", "bench", "serving_load")]
    before = server.compute_totals()
    out = subprocess.run(
        load + ["--target", f"127.0.0.1:{server.port}", "--pid", str(server.proc.pid),
                "--method", method, "--batch", str(batch), "--seq", str(seq),
                "--callers", str(callers), "--seconds", str(args.seconds)],
        check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    after = server.compute_totals()
    if after is not None and after["calls"] > before["calls"]:
        # The layer's own time per call (its compute runs' wall time, shared among the calls
        # each run held): what is left of the server's CPU per call is serving.
        result["compute_us_per_call"] = (
            (after["seconds"] - before["seconds"]) / (after["calls"] - before["calls"]) * 1e6)
    return result


def measure(args, *runs):
    """Medians of args.reps repetitions of each (server, options) run, the runs interleaved in
    every repetition, so a load change on the shared machine hits all of them alike."""
    results = [[] for _ in runs]
    for _ in range(args.reps):
        for i, (server, options) in enumerate(runs):
            if server is not None:
                results[i].append(run_once(args, server, **options))
    keys = ["calls_per_s", "ok_per_s", "server_cpu_us_per_call", "p50_ms", "p99_ms",
            "compute_us_per_call"]
    medians = []
    for r in results:
        if not r:
            medians.append(None)
            continue
        median = {k: statistics.median(x[k] for x in r) for k in keys if k in r[0]}
        median["codes"] = r[-1]["codes"]
        medians.append(median)
    return medians if len(medians) > 1 else medians[0]


def layer_alone(args):
    """attnserve_bench's `small` shape (the demo layer's 1x16 call) on one thread: warm (back to
    back, as in a busy server) and cold (alternating with a 4096^3 matmul), each with the peak
    of that matmul measured in the same run."""
    bench = os.path.join(args.build, "tests", "bench", "attnserve_bench")
    out = {}
    for mode, flags in (("warm", ["--warm"]), ("cold", [])):
        text = subprocess.run([bench, "--shapes", "small", "--threads", "1", "--reps", "20",
                               *flags], check=True, capture_output=True, text=True).stdout
        out[mode] = json.loads(text.splitlines()[0])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", default=os.path.join(HERE, "../../build"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--server-args", default="", help="extra attnserve flags for every run")
    p.add_argument("--client", choices=["cpp", "python"], default="cpp",
                   help="the load's client: serving_load (C++) or serving_load.py (grpcio, "
                        "the client a Python user would have)")
    args = p.parse_args()
    binary = os.path.join(args.build, "server", "attnserve")
    extra = shlex.split(args.server_args)

    def attnserve(name, *flags):
        port = free_port()
        # Metrics on, as deployed, each server on a port of its own.
        metrics_port = None if "--metrics-listen" in extra else free_port()
        metrics = [] if metrics_port is None else ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
        return Server(name, [binary, "--listen", f"127.0.0.1:{port}", "--log-level", "warn",
                             *metrics, *flags, *extra], port, metrics_port)

    print(f"load before: {os.getloadavg()}; client: {args.client}", file=sys.stderr)
    ours = attnserve("attnserve")
    off = attnserve("nobatch", "--max-batch-tokens", "0")
    base = None
    if not args.no_baseline:
        port = free_port()
        base = Server("baseline", ["/usr/bin/python3", os.path.join(HERE, "baseline_server.py"),
                                   "--port", str(port), "--stubs",
                                   os.path.join(args.build, "python")], port)
    rows = []
    try:
        alone = layer_alone(args)  # the servers are idle meanwhile
        floor = measure(args, (ours, {"method": "health"}))
        rows.append(("health Check (floor), 8 callers", floor, None, None))
        for batch, seq in [(1, 16), (1, 128), (8, 128), (4, 256)]:
            shape = {"batch": batch, "seq": seq}
            on, nob, bl = measure(args, (ours, shape), (off, shape), (base, shape))
            rows.append((f"Forward {batch}x{seq}, 8 callers", on, nob, bl))
        infer, forward = measure(args, (ours, {"method": "infer"}), (ours, {}))
        rows.append(("ModelInfer 1x16, 8 callers", infer, None, None))
        gain_on, gain_off = measure(args, (ours, {"callers": 64}), (off, {"callers": 64}))
        rows.append(("Forward 1x16, 64 callers", gain_on, gain_off, None))
        one_on, one_off = measure(args, (ours, {"callers": 1}), (off, {"callers": 1}))
        rows.append(("Forward 1x16, 1 caller", one_on, one_off, None))
        few, many = measure(args, (ours, {"batch": 4, "seq": 256, "callers": 32}),
                            (ours, {"batch": 4, "seq": 256, "callers": 256}))
        rows.append(("Forward 4x256, 32 callers", few, None, None))
        rows.append(("Forward 4x256, 256 callers", many, None, None))
    finally:
        for s in (ours, off, base):
            if s:
                s.stop()
    print(f"load after: {os.getloadavg()}", file=sys.stderr)

    def cell(m):
        if m is None:
            return f"{'':>9} {'':>8} {'':>8} {'':>8}"
        layer = f"{m['compute_us_per_call']:8.0f}" if "compute_us_per_call" in m else f"{'':>8}"
        return (f"{m['calls_per_s']:9.0f} {m['server_cpu_us_per_call']:8.0f} {layer} "
                f"{m['p99_ms']:8.2f}")

    # cpu us: the server's CPU per call (/proc); layer us: its compute runs' wall time per call
    # (its /metrics), the part of the call that is the layer itself.
    print(f"{'':34} {'attnserve (batching on)':>36} | {'batching off':>36} | {'baseline':>36}")
    print(f"{'row':34} " + " | ".join(
        [f"{'calls/s':>9} {'cpu us':>8} {'layer us':>8} {'p99 ms':>8}"] * 3))
    for name, a, b, c in rows:
        print(f"{name:34} {cell(a)} | {cell(b)} | {cell(c)}")
    print()
    f_cpu, f_rate = floor["server_cpu_us_per_call"], floor["calls_per_s"]
    small = rows[1][1]
    print(f"1x16 Forward / health Check: calls/s {small['calls_per_s'] / f_rate:.2f}, "
          f"server CPU per call {small['server_cpu_us_per_call'] / f_cpu:.2f}")
    print(f"ModelInfer / Forward 1x16, server CPU per call: "
          f"{infer['server_cpu_us_per_call'] / forward['server_cpu_us_per_call']:.2f} (target <= 1.10)")
    if base:
        for name, a, _, c in rows[1:5]:
            print(f"{name}: attnserve / baseline calls/s {a['calls_per_s'] / c['calls_per_s']:.2f}")
    print(f"batching gain, 1x16 at 64 callers (server CPU per call, off / on): "
          f"{gain_off['server_cpu_us_per_call'] / gain_on['server_cpu_us_per_call']:.2f}")
    print(f"p99 at 1 caller, on / off: {one_on['p99_ms'] / one_off['p99_ms']:.2f}")
    print(f"overload, 4x256: ok calls/s at 256 / at 32 callers: "
          f"{many['ok_per_s'] / few['ok_per_s']:.2f} (codes at 256: {many['codes']})")
    # What the layer alone costs, and the best figures that leaves for a server that ran it at
    # the rate of a large oneDNN matmul on one core (the engine's measured best, not the CPU's
    # limit) and spent nothing beyond the floor of a gRPC call on it.
    warm, cold = alone["warm"], alone["cold"]
    flops16 = warm["useful_gflops"] * warm["ms"] * 1e6
    peak = warm["peak_gflops"] * 1e3  # FLOP per us

    def layer_flops(tokens, d=256):  # the demo layer, bidirectional: projections + attention
        return 8 * d * d * tokens + 4 * d * tokens * tokens

    assert abs(layer_flops(16) / flops16 - 1) < 0.01, "attnserve_bench's small is not the demo 1x16"
    least16 = flops16 / peak + f_cpu
    least128 = layer_flops(128) / peak + f_cpu
    print(f"the 1x16 layer alone (attnserve_bench small, 1 thread): warm {warm['ms'] * 1e3:.0f} us, "
          f"cold {cold['ms'] * 1e3:.0f} us; at a 4096^3 matmul's rate on one core "
          f"({warm['peak_gflops']:.0f} GFLOP/s, same run) its {flops16 / 1e6:.1f} MFLOP take "
          f"{flops16 / peak:.0f} us")
    print("ceilings, for a server whose only costs were the layer at that rate and the floor:")
    print(f"  1x16 server CPU per call >= {least16:.0f} us = {least16 / f_cpu:.2f}x the floor "
          f"(target <= 2.5x)")
    print(f"  batching gain at 64 callers <= {gain_off['server_cpu_us_per_call'] / least16:.2f} "
          f"(target >= 2)")
    if base:
        print(f"  calls/s against the baseline when both are bound by the same cores (baseline's "
              f"CPU per call / ours at best): 1x16 <= "
              f"{rows[1][3]['server_cpu_us_per_call'] / least16:.2f} (target >= 6), 1x128 <= "
              f"{rows[2][3]['server_cpu_us_per_call'] / least128:.2f} (target >= 4)")


if __name__ == "__main__":
    main()
