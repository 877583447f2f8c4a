#!/usr/bin/python3
"""ctest driver: client/python/decode_example.py against real attnserve servers.

1. An unbroken generation (prompt 16, 60 steps, each output fed back) is the reference.
2. The server is drained mid-generation (SIGTERM: it ends its streams, refuses new ones while it
   goes) and another starts on the same address once it has gone: the example waits, replays its
   prefix on a new stream, and its outputs equal the reference within 1e-5.
3. Two replicas behind a static list and round robin: the one holding the session dies and the
   example goes on on the other, again equal to the reference.
4. Over TLS with a bearer token from ATTNSERVE_TOKEN: the same outputs; without it, refused.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

STEPS = 60
# Each step waits this long in the runs where a replica dies, so that a generation outlasts the
# test's own waits (a replica's start on a loaded machine) by seconds, not milliseconds.
STEP_DELAY = "0.1"


def free_port():
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server, workdir, port, name, extra=()):
    """attnserve on 127.0.0.1:port, once it has written its port file."""
    port_file = os.path.join(workdir, f"{name}.port")
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    proc = subprocess.Popen([server, "--listen", f"127.0.0.1:{port}", "--port-file", port_file,
                             "--threads", "2", "--metrics-listen=off", "--http-listen=off",
                             "--log-level", "warn",
                             *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"attnserve {name} exited at start:\n{open(log.name).read()}")
        if os.path.exists(port_file) and open(port_file).read().endswith("\n"):
            return proc
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"attnserve {name} wrote no port in 60 s")


def stop(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def example(args, workdir, name, target, extra=()):
    """Starts decode_example.py; returns (process, output .npy path)."""
    out = os.path.join(workdir, f"{name}.npy")
    argv = [sys.executable, args.example, "--target", target, "--stubs", args.stubs,
            "--prompt", "16", "--steps", str(STEPS), "--seed", "3", "--output", out, *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def wait_for_steps(proc, seconds):
    """Reads the example's first line (it has a session coming), then lets it step a while."""
    line = proc.stdout.readline()
    assert line.startswith("model "), line
    time.sleep(seconds)
    assert proc.poll() is None, "the example finished before the replica died: slow it down"


def finish(proc, out, reference, what):
    text = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, f"{what}: example exited {proc.returncode}\n{text}"
    assert "replayed" in text, f"{what}: no replay happened\n{text}"
    got = np.load(out)
    assert got.shape == reference.shape, (got.shape, reference.shape)
    worst = float(np.abs(got - reference).max())
    assert worst <= 1e-5, f"{what}: outputs differ from the unbroken run by {worst}\n{text}"
    print(f"{what}: replayed and equal to the unbroken run (max |diff| {worst:.2e})")


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--server", "--stubs", "--example"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        # 1. The reference: no replica dies.
        port = free_port()
        first = start_server(args.server, workdir, port, "first")
        try:
            proc, out = example(args, workdir, "reference", f"127.0.0.1:{port}")
            text = proc.stdout.read()
            assert proc.wait(timeout=120) == 0, text
            assert "0 replays" in text, text
            reference = np.load(out)
            assert reference.shape == (STEPS, 256), reference.shape
            # Each step's output is a new row: a replay that lost or repeated a token shows.
            assert np.abs(np.diff(reference, axis=0)).max(axis=1).min() > 1e-4

            # 2. The server is drained mid-generation; another starts on the same address.
            # Up to 10 new streams, 0.1 s apart doubling to 1 s: time for a loaded machine to
            # drain the server and start the next.
            proc, out = example(args, workdir, "restart", f"127.0.0.1:{port}",
                                ["--step-delay", STEP_DELAY, "--max-replays", "10"])
            wait_for_steps(proc, 0.6)
            stop(first, signal.SIGTERM)
            first = start_server(args.server, workdir, port, "second")
            finish(proc, out, reference, "drained, and another on the same address")
        finally:
            stop(first)

        # 3. Two replicas, round robin over a static list; the session's replica dies.
        port_a = free_port()
        a = start_server(args.server, workdir, port_a, "replica-a")
        port_b = free_port()
        b = None
        try:
            target = f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}"
            proc, out = example(args, workdir, "replicas", target,
                                ["--step-delay", STEP_DELAY, "--lb-policy", "round_robin"])
            wait_for_steps(proc, 0.3)  # the session is on a: b is not up yet
            b = start_server(args.server, workdir, port_b, "replica-b")
            time.sleep(1.5)  # the channel connects to b (reconnect backoff <= 1 s)
            assert proc.poll() is None, "the example finished before replica a died: slow it down"
            stop(a, signal.SIGKILL)
            finish(proc, out, reference, "another replica")
        finally:
            stop(a)
            if b is not None:
                stop(b)

        # 4. TLS and a token (certificates as python_example_test.py makes them).
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from python_example_test import make_certificates
        ca, cert, key = make_certificates(workdir)
        tokens = os.path.join(workdir, "tokens")
        with open(tokens, "w") as f:
            f.write("decode-token\n")
        port = free_port()
        tls = start_server(args.server, workdir, port, "tls",
                           ["--tls-cert", cert, "--tls-key", key, "--auth-token-file", tokens])
        try:
            os.environ["ATTNSERVE_TOKEN"] = "decode-token"
            proc, out = example(args, workdir, "tls", f"localhost:{port}", ["--tls-ca", ca])
            text = proc.stdout.read()
            assert proc.wait(timeout=120) == 0, text
            worst = float(np.abs(np.load(out) - reference).max())
            assert worst <= 1e-5, worst
            del os.environ["ATTNSERVE_TOKEN"]
            proc, out = example(args, workdir, "no-token", f"localhost:{port}", ["--tls-ca", ca])
            text = proc.stdout.read()
            assert proc.wait(timeout=120) != 0 and "UNAUTHENTICATED" in text, text
            print("over TLS with a token: equal to the unbroken run; UNAUTHENTICATED without")
        finally:
            stop(tls)
    print("ok")


if __name__ == "__main__":
    main()
