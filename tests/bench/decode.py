#!/usr/bin/python3
"""The decode-session benchmark: one run, printing ratios. Run by hand, not by ctest:

  /usr/bin/python3 tests/bench/decode.py [--build build] [--quick] [--skip-4096] [--peer-only]

Starts attnserve (f32 cache, then --kv-cache-precision bf16) with the demo layer and a
768-wide 12-head layer whose weights numpy writes into a temp dir, and drives it with the C++
load tester (attnserve-client bench --decode/--json); Python only orchestrates. Prints:

- the memory-bound ceiling measured in the same run: a large memory copy's bandwidth (numpy,
  1 GiB, one and two threads, read + write bytes; the best of 3 copies just before and 3 just
  after each row, since a shared machine's bandwidth moves by a quarter within a minute) / the
  cache bytes a token's step reads (2 * inner * element bytes * mean cached length) -> max
  tokens/s; and the sessions' tokens/s (64 streams of one sequence, one stream of B = 64;
  prompt 512 and 4096, 128 steps of 1 token), as a ratio to it (target >= 0.6 on the 768-wide
  layer); beside them the same step of the same sequences through Layer::Decode alone, no
  server (attnserve_decode_bench), against the same kind of ceiling: as near as a row can come;
- the ceiling with the load tester on the same cores (prompt 512, 768-wide): per token, the
  client's CPU, gRPC's own server CPU per message (grpc_floor, 16 streams in flight) and the
  attention's memory time on every core must fit in the cores' time; the sessions' tokens/s as
  a share of that (medians of three alternations);
- recompute: the same generation done by Forward over the whole prefix each step, one
  sequence, 768-wide, prompts 128, 512 and 2048 (target >= 20x at 512);
- server CPU (/proc/PID/stat utime + stime) per 1-token streamed step / per unary 1x1 Forward
  (target <= 0.6), 1 and 16 in flight, with the load tester as the client and with gRPC's
  generic client (grpc_floor --drive --attnserve); beside the same ratio for gRPC alone with that
  client (grpc_floor.cc: attnserve's Forward and Decode, registered as attnserve registers them,
  answered with canned replies of the same size), and attnserve's own CPU above gRPC's per step
  and per call;
- step latency p99 of 32 sessions with and without 4096-token prompts arriving (chunked
  prefill; target <= 2x), and the same with causal cross sessions of 16,384-token contexts
  arriving (a context is projected as the queries reach it, so held to the same): the median of
  five with/without pairs (one with --quick), each pair seeing only a few arrivals;
- peer: the same session workload (768-wide, 64 streams of one sequence and one stream of
  B = 64, prompt 512, 128 steps of 1 token) against attnserve and against pytorch_kv_server.py,
  a grpcio + PyTorch server that batches every waiting stream's step into one matmul and keeps a
  KV cache per session: tokens/s of each and attnserve / peer (target >= 5x), each row beside its
  memory-bound ceiling, so the ceiling / the peer's tokens/s says how far ahead of the peer any
  server could be on this machine; the two servers alternate three times, and each figure is
  the median of its three. --peer-only runs this section alone. The peer needs
  python3-torch with OpenBLAS (libopenblas0-openmp).
"""
import argparse
import functools
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from save_layer import save_layer  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=1)
def copy_buffers(gib):
    """A source and a destination of `gib` GiB, every page touched; made once, for every row's
    copies."""
    src = np.ones((gib << 30) // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return src, dst


def copy_bandwidth(gib=1, reps=3):
    """Bytes/s (read + write) of the best 1 GiB copy, one thread or two (numpy frees the GIL)."""
    src, dst = copy_buffers(gib)
    n = len(src)
    best = 0.0
    for threads in (1, 2):
        bounds = [(n * i // threads, n * (i + 1) // threads) for i in range(threads)]
        for _ in range(reps):
            workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b]))
                       for a, b in bounds]
            t = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = max(best, 2 * src.nbytes / (time.perf_counter() - t))
    return best


def beside_copies(run):
    """`run`'s result and the copy bandwidth beside it: the best of the copies just before and
    just after (a shared machine's bandwidth moves by a quarter within a minute)."""
    before = copy_bandwidth()
    result = run()
    return result, max(before, copy_bandwidth())


# The 768-wide 12-head layer's width: its heads' keys and values are as wide.
WIDE = 768
# The context of the causal cross sessions that arrive beside generating sessions (50 MB, in the
# first message).
CONTEXT = 16384


def cache_bytes(inner, element_bytes, prompt, steps):
    """The cache bytes a token's step reads, on the mean over `steps` steps after a `prompt`:
    every cached position's key and value."""
    return 2 * inner * element_bytes * (prompt + steps / 2)


def write_wide_layer(path, d=WIDE, heads=12):
    rng = np.random.default_rng(11)
    s = 1 / np.sqrt(d)
    save_layer(path, {"in_proj_weight": rng.standard_normal((3 * d, d)) * s,
                      "in_proj_bias": rng.standard_normal(3 * d) * 0.02,
                      "out_proj.weight": rng.standard_normal((d, d)) * s,
                      "out_proj.bias": rng.standard_normal(d) * 0.02}, num_heads=heads)


def wait_for_port(proc, port_file, what, log=None, timeout=120):
    """Waits until `proc` has written its port (a line) to `port_file`; returns the port. Raises,
    with `what` and the log's text, if it exits or takes longer than `timeout` seconds."""
    deadline = time.time() + timeout
    while not (os.path.exists(port_file) and open(port_file).read().endswith("\n")):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{what} did not start: {open(log).read() if log else ''}")
        time.sleep(0.05)
    return int(open(port_file).read())


class Server:
    def __init__(self, binary, workdir, models, extra):
        self.port = free_port()
        self.log = open(os.path.join(workdir, f"server-{self.port}.log"), "w")
        port_file = os.path.join(workdir, f"port-{self.port}")
        argv = [binary, "--listen", f"127.0.0.1:{self.port}", "--port-file", port_file,
                "--metrics-listen", "off", "--http-listen", "off", "--log-level", "warn"]
        argv += [f"--model={m}" for m in models] + list(extra)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for_port(self.proc, port_file, "attnserve", self.log.name)
        self.target = f"127.0.0.1:{self.port}"

    def cpu_seconds(self):
        fields = open(f"/proc/{self.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class PeerServer(Server):
    """pytorch_kv_server.py serving one layer file as `name`, the same way attnserve is run."""

    def __init__(self, build, workdir, name, layer):
        self.port = free_port()
        self.log = open(os.path.join(workdir, f"peer-{self.port}.log"), "w")
        port_file = os.path.join(workdir, f"peer-port-{self.port}")
        argv = [sys.executable, os.path.join(HERE, "pytorch_kv_server.py"), "--weights", layer,
                "--name", name, "--port", str(self.port), "--port-file", port_file,
                "--build", build]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for_port(self.proc, port_file, "the PyTorch peer", self.log.name)
        self.target = f"127.0.0.1:{self.port}"


class Bench:
    def __init__(self, client, target):
        self.client, self.target = client, target

    def run(self, *args, background=False):
        argv = [self.client, "--target", self.target, "--timeout", "600", "bench",
                *[str(a) for a in args], "--json"]
        if background:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr[-2000:]}")
        return json.loads(r.stdout)

    def decode(self, model, sessions, batch, prompt, steps, k=1):
        return self.run("--decode", "--model", model, "--sessions", sessions, "--batch", batch,
                        "--prompt", prompt, "--steps", steps, "--tokens-per-step", k)

    def forward(self, model, shape, requests, concurrency=1):
        return self.run("--model", model, "--kind", "causal", "--random", shape, "--requests",
                        requests, "--duration", 0, "-c", concurrency, "--warmup-seconds", 0.2)


def ceiling_rows(bench, models, element_bytes, lengths, steps, label):
    """Sessions' tokens/s for N streams and one stream of B=N (N = 64, or --long-sequences at
    cache length 4096), as a share of the memory-bound ceiling. This machine's bandwidth moves by
    a quarter within a minute, so each row has its own ceiling: the best copy of those just
    before and just after it (best of 3 each, one and two threads)."""
    rows = []
    for name, inner in models:
        for prompt, n in lengths:
            per_token = cache_bytes(inner, element_bytes, prompt, steps)
            for sessions, batch in ((n, 1), (1, n)):
                r, bandwidth = beside_copies(
                    lambda: bench.decode(name, sessions, batch, prompt, steps))
                ceiling = bandwidth / per_token
                tps = r["decode"]["tokens_per_second"]
                rows.append((label, name, prompt, f"{sessions}x B={batch}", tps, ceiling,
                             r["decode"]["inter_token_latency_ms"]["p99"]))
                print(f"  {label} {name:5s} prompt {prompt:5d} {sessions:2d} sessions x "
                      f"B={batch:2d}: {tps:9.0f} tokens/s, copy {bandwidth / 1e9:.1f} GB/s -> "
                      f"ceiling {ceiling:9.0f} -> {tps / ceiling:.3f}", flush=True)
    return rows


def engine_rows(build, precision, element_bytes, lengths, steps):
    """The step of the ceiling rows' sequences through Layer::Decode alone, no server
    (attnserve_decode_bench: 768-wide, one token a sequence, at the rows' mean cached length;
    the median of 7 steps, each after a 1 GiB read and copy, so its caches start as cold as a
    session's), against the ceiling the rows have: the best copy just before and just after it.
    As near as a row can come, a step's projections taking their time beside the cache's read.
    And how near the engine could come if the projections ran beside the attention (its
    --overlap bound: the step's share times the step's time over the bound)."""
    rows = []
    for prompt, n in lengths:
        cached = prompt + steps // 2
        argv = [os.path.join(build, "tests", "bench", "attnserve_decode_bench"), "--sequences",
                str(n), "--cached", str(cached), "--kv-precision", precision, "--reps", "7"]
        r, bandwidth = beside_copies(
            lambda: subprocess.run(argv, check=True, capture_output=True, text=True))
        tps = json.loads(r.stdout.splitlines()[-1])["tokens_per_s"]
        ceiling = bandwidth / cache_bytes(WIDE, element_bytes, prompt, steps)
        overlap = json.loads(subprocess.run(argv + ["--overlap"], check=True, capture_output=True,
                                            text=True).stdout.splitlines()[-1])["step_over_bound"]
        rows.append((prompt, n, tps, ceiling, overlap))
        print(f"  {precision} engine alone (Layer::Decode), wide, {n} sequences at {cached} "
              f"cached: {tps:9.0f} tokens/s, copy {bandwidth / 1e9:.1f} GB/s -> ceiling "
              f"{ceiling:9.0f} -> {tps / ceiling:.3f}; step / its bound with the projections "
              f"beside the attention {overlap:.3f} -> at most {tps * overlap / ceiling:.3f}",
              flush=True)
    return rows


def shared_cores_run(server, bench, floor_message_cpu, name, inner, element_bytes, prompt,
                     sessions, batch, steps):
    """One run of shared_cores_rows for `sessions` streams of B = `batch`: its tokens/s, its
    ceiling and its client's CPU per token, printed with the server's."""
    cores = len(os.sched_getaffinity(0))
    cpu = {}
    before = copy_bandwidth()
    for k in (steps, 1):
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        server_before = server.cpu_seconds()
        r = bench.decode(name, sessions, batch, prompt, k)
        client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu[k] = (server.cpu_seconds() - server_before,
                  client_after.ru_utime + client_after.ru_stime - client_before.ru_utime -
                  client_before.ru_stime, r["decode"]["tokens_per_second"])
    bandwidth = max(before, copy_bandwidth())
    memory_cpu = cores * cache_bytes(inner, element_bytes, prompt, steps) / bandwidth
    tokens = sessions * batch * (steps - 1)
    server_cpu = (cpu[steps][0] - cpu[1][0]) / tokens
    # One stream of B = n sends few messages: its client's share is below what the prompts'
    # runs vary by, and the difference can come out negative. None is counted then (a
    # negative share would raise the ceiling).
    client_cpu = max(cpu[steps][1] - cpu[1][1], 0.0) / tokens
    ceiling = cores / (client_cpu + floor_message_cpu / batch + memory_cpu)
    tps = cpu[steps][2]
    print(f"  shared cores: {name} prompt {prompt} {sessions:2d} sessions x B={batch:2d}: "
          f"{tps:9.0f} tokens/s; per token: server CPU {server_cpu * 1e6:.0f} us, client CPU "
          f"{client_cpu * 1e6:.0f} us, gRPC floor {floor_message_cpu / batch * 1e6:.1f} us, "
          f"memory {memory_cpu * 1e6:.0f} us of {cores} cores -> ceiling {ceiling:9.0f} "
          f"tokens/s, {tps / ceiling:.3f} of it", flush=True)
    return tps, ceiling, client_cpu


def shared_cores_rows(server, bench, floor_message_cpu, name, inner, element_bytes, prompt, n,
                      steps, reps):
    """The same machine also runs the load tester, and each streamed message costs gRPC its own
    server CPU: with 64 streams of one sequence these take cores from the memory-bound attention.
    Per token, the cores must give the client's CPU (measured: a run of `steps` less a run of
    one step, so the prefill cancels), gRPC's floor per message (grpc_floor) and the attention's
    memory time on both cores (at the copy bandwidth beside the run, as ceiling_rows); tokens/s
    <= cores / their sum. Printed beside the sessions' tokens/s, for n streams of B = 1 and one
    stream of B = n, with the server's CPU per token. The two alternate `reps` times; each figure
    is the median of its reps (its share of the ceiling, the median of the reps' shares)."""
    shapes = ((n, 1), (1, n))
    runs = {shape: [] for shape in shapes}
    for _ in range(reps):
        for sessions, batch in shapes:
            runs[sessions, batch].append(
                shared_cores_run(server, bench, floor_message_cpu, name, inner, element_bytes,
                                 prompt, sessions, batch, steps))
    rows = []
    for (sessions, batch), measured in runs.items():
        tps, ceiling, client_cpu = (median([run[i] for run in measured]) for i in range(3))
        share = median([run[0] / run[1] for run in measured])
        rows.append((name, prompt, f"{sessions}x B={batch}", tps, ceiling, share, client_cpu))
    return rows


def recompute_rows(bench, model, prompts, steps):
    """One sequence generating `steps` tokens: a session vs Forward over the prefix each step."""
    rows = []
    for prompt in prompts:
        session = bench.decode(model, 1, 1, prompt, steps)["decode"]["tokens_per_second"]
        # Forward over the prefix: its length grows from prompt to prompt + steps; the mean
        # length's latency is each step's mean cost (compute grows about linearly with it here).
        length = prompt + steps // 2
        fwd = bench.forward(model, f"1,{length}", max(8, min(steps, 64)))
        recompute = 1000.0 / fwd["latency_ms"]["mean"]
        rows.append((prompt, session, recompute))
        print(f"  recompute {model} prompt {prompt:5d}: session {session:8.0f} tokens/s, "
              f"Forward over the prefix {recompute:8.1f} tokens/s -> {session / recompute:.1f}x",
              flush=True)
    return rows


# Calls or streams at once in the serving-cost sections.
IN_FLIGHT = (1, 16)


def median(values):
    return sorted(values)[len(values) // 2]


def cpu_ratio(server, bench, model, quick):
    """Server CPU per 1-token streamed step / per unary 1x1 Forward, 1 and 16 in flight, with the
    load tester as the client. Each session steps 128 times (its cache stays short: the step's
    attention costs next to nothing), and the Forward calls are as many as the messages of the
    sessions (prompt and steps), sent by as many runs of the load tester (each opens its own
    connection, whose setup the server pays either way). Steps and calls alternate three times
    (once with --quick), each measure over at least ~4000 messages a rep (/proc counts CPU in
    10 ms ticks); the medians are printed."""
    def per_message(runs, one_run):
        """Server CPU per message over `runs` runs of the load tester, and the messages (one_run
        runs it once and returns the messages it sent)."""
        before = server.cpu_seconds()
        messages = sum(one_run() for _ in range(runs))
        return (server.cpu_seconds() - before) / messages, messages

    rows = {}
    reps = 1 if quick else 3
    steps = 128
    for in_flight in IN_FLIGHT:
        runs = (4 if quick else 32) if in_flight == 1 else (1 if quick else 8)
        step_cpus, forward_cpus = [], []
        for _ in range(reps):
            step_cpu, messages = per_message(
                runs, lambda: bench.decode(model, in_flight, 1, 1, steps)["sent"])
            step_cpus.append(step_cpu)
            forward_cpus.append(per_message(runs, lambda: bench.run(
                "--model", model, "--kind", "causal", "--random", "1,1", "--requests",
                messages // runs, "--duration", 0, "-c", in_flight, "--warmup-seconds", 0,
                "--warmup", 0)["ok"])[0])
        step_cpu, forward_cpu = median(step_cpus), median(forward_cpus)
        rows[in_flight] = step_cpu, forward_cpu
        print(f"  load tester, {in_flight:2d} in flight: {step_cpu * 1e6:.1f} us per streamed "
              f"1-token step, {forward_cpu * 1e6:.1f} us per unary 1x1 Forward -> "
              f"{step_cpu / forward_cpu:.2f} (medians of {reps})", flush=True)
    return rows


def generic_client_rows(build, pid, target, messages, reps, label, names, model=None):
    """Server CPU per streamed message and per unary call of grpc_floor's client (gRPC's generic
    stub, callback API: the cheapest client gRPC has), 1 and 16 callers, streams of 129 messages:
    against the echo server, or (`model`) attnserve's 1-token Decode steps and 1x1 causal Forward
    calls. Medians of `reps` runs, printed with `label` and the `names` of a message and a call.
    Returns {in_flight: (message, call)}."""
    argv = [os.path.join(build, "tests", "bench", "grpc_floor"), "--drive", target, "--pid",
            str(pid), "--messages", str(messages)]
    if model is not None:
        argv += ["--attnserve", model]
    rows = {}
    for in_flight in IN_FLIGHT:
        streams, calls = [], []
        for _ in range(reps):
            r = json.loads(subprocess.run(argv + ["--in-flight", str(in_flight)], check=True,
                                          capture_output=True, text=True).stdout)
            streams.append(r["stream_message_cpu_us"] / 1e6)
            calls.append(r["unary_cpu_us"] / 1e6)
        stream_cpu, unary_cpu = rows[in_flight] = median(streams), median(calls)
        print(f"  {label}, {in_flight:2d} in flight: {stream_cpu * 1e6:.1f} us per {names[0]}, "
              f"{unary_cpu * 1e6:.1f} us per {names[1]} -> {stream_cpu / unary_cpu:.2f}",
              flush=True)
    return rows


def grpc_floor(build, workdir, messages, reps):
    """gRPC's own server CPU per streamed message and per unary call, 1 and 16 in flight:
    grpc_floor.cc (a callback server, as attnserve's, serving attnserve.v1's Forward and Decode
    as attnserve registers them, and answering each call and step with a canned reply of the
    demo layer's size) driven by its own client with attnserve's messages. Returns
    {in_flight: (message, call)}."""
    binary = os.path.join(build, "tests", "bench", "grpc_floor")
    port_file = os.path.join(workdir, "grpc-floor-port")
    if os.path.exists(port_file):
        os.remove(port_file)
    proc = subprocess.Popen([binary, "--port-file", port_file])
    try:
        port = wait_for_port(proc, port_file, "grpc_floor", timeout=30)
        return generic_client_rows(build, proc.pid, f"127.0.0.1:{port}", messages, reps,
                                   "gRPC alone (grpc_floor)",
                                   ("streamed message", "unary call"), "demo")
    finally:
        proc.terminate()
        proc.wait()


def arrivals_p99(bench, model, steps, arrival, what, pairs):
    """Step p99 of 32 sessions alone, then with sessions of `arrival` (bench arguments) arriving
    one after another all the while, `pairs` times: each pair sees only a few arrivals, so its
    p99 is set by the few runs a chunk of theirs shared, and moves a lot from pair to pair.
    Returns the pair of median ratio (alone, busy) and every pair's ratio."""
    measured = []
    for _ in range(pairs):
        alone = bench.decode(model, 32, 1, 128, steps)["decode"]["inter_token_latency_ms"]["p99"]
        stop = threading.Event()
        arrived = [0]

        def arrive():
            while not stop.is_set():
                bench.run("--decode", "--model", model, "--sessions", 1, *arrival)
                arrived[0] += 1
        feeder = threading.Thread(target=arrive)
        feeder.start()
        time.sleep(0.5)
        try:
            busy = bench.decode(model, 32, 1, 128, steps)["decode"]["inter_token_latency_ms"]["p99"]
        finally:
            stop.set()
            feeder.join()
        print(f"  step p99 {alone:.2f} ms alone, {busy:.2f} ms with {what} arriving "
              f"({arrived[0]} of them) -> {busy / alone:.2f}x", flush=True)
        measured.append((alone, busy))
    measured.sort(key=lambda pair: pair[1] / pair[0])
    return measured[len(measured) // 2], [busy / alone for alone, busy in measured]


def peer_rows(server_bin, client_bin, build, workdir, layer, n, prompt, steps, reps):
    """Sessions' tokens/s of attnserve and of the PyTorch peer, one server at a time, for n
    streams of one sequence and one stream of B = n on the 768-wide layer, each row beside its
    memory-bound ceiling (as ceiling_rows): the peer's share of it bounds how far any server can
    be ahead of the peer on this machine (ceiling / peer). The two servers alternate `reps` times
    and each figure is the median of its runs: attnserve's rows move with the memory's
    bandwidth, which moves by a quarter within a minute here."""
    shapes = ((n, 1), (1, n))
    per_token = cache_bytes(WIDE, 4, prompt, steps)
    tps, ceiling = {}, {}
    for rep in range(reps):
        for who in ("attnserve", "peer"):
            server = (Server(server_bin, workdir, [f"wide={layer}:num_heads=12"],
                             ["--kv-cache-mib", "8192"]) if who == "attnserve"
                      else PeerServer(build, workdir, "wide", layer))
            bench = Bench(client_bin, server.target)
            try:
                bench.decode("wide", 2, 2, 32, 4)  # a warm-up: first calls' setup, untimed
                for sessions, batch in shapes:
                    r, bandwidth = beside_copies(
                        lambda: bench.decode("wide", sessions, batch, prompt, steps))
                    key = who, sessions, batch
                    tps.setdefault(key, []).append(r["decode"]["tokens_per_second"])
                    ceiling.setdefault(key, []).append(bandwidth / per_token)
                    print(f"  {rep + 1}/{reps} {who:9s} wide prompt {prompt:4d} {sessions:2d} "
                          f"sessions x B={batch:2d}: {tps[key][-1]:9.0f} tokens/s, step p99 "
                          f"{r['decode']['inter_token_latency_ms']['p99']:.1f} ms, "
                          f"{tps[key][-1] / ceiling[key][-1]:.3f} of the ceiling", flush=True)
            finally:
                server.stop()
    rows = []
    for sessions, batch in shapes:
        ours = median(tps["attnserve", sessions, batch])
        peer = median(tps["peer", sessions, batch])
        most = median([c / t for c, t in zip(ceiling["peer", sessions, batch],
                                             tps["peer", sessions, batch])])
        rows.append((prompt, f"{sessions}x B={batch}", ours, peer, most))
        print(f"  attnserve / peer, {sessions:2d} sessions x B={batch:2d}, medians of {reps}: "
              f"{ours:.0f} / {peer:.0f} = {ours / peer:.1f}x (the ceiling beside the peer's row "
              f"is {most:.1f}x the peer's tokens/s)", flush=True)
    return rows


def other_sections(table, args, server_bin, client_bin, workdir, layer, steps, lengths):
    """The sections before the peer's: the ceiling, recompute, serving cost, chunked prefill and
    contexts."""
    models = [("demo", 256), ("wide", WIDE)]
    print("gRPC's own floor:", flush=True)
    floor_messages, floor_reps = (1032, 1) if args.quick else (8256, 3)
    table["floor"] = grpc_floor(args.build, workdir, floor_messages, floor_reps)
    specs = ["demo=built-in", f"wide={layer}:num_heads=12"]
    for precision, element_bytes in (("f32", 4), ("bf16", 2)):
        server = Server(server_bin, workdir, specs,
                        ["--kv-cache-precision", precision, "--kv-cache-mib", "8192"])
        bench = Bench(client_bin, server.target)
        try:
            print(f"sessions vs the memory-bound ceiling, {precision} cache:", flush=True)
            table[f"ceiling_{precision}"] = ceiling_rows(bench, models, element_bytes, lengths,
                                                         steps, precision)
            table[f"engine_{precision}"] = engine_rows(args.build, precision, element_bytes,
                                                       lengths, steps)
            if precision == "f32":
                print("the ceiling with the load tester on the same cores (768-wide, f32):",
                      flush=True)
                table["shared"] = shared_cores_rows(server, bench, table["floor"][16][0],
                                                    "wide", WIDE, element_bytes, lengths[0][0],
                                                    lengths[0][1], steps,
                                                    reps=1 if args.quick else 3)
                print("against recompute (768-wide, one sequence):", flush=True)
                table["recompute"] = recompute_rows(bench, "wide", [128, 512, 2048], steps)
                print("serving cost (demo layer):", flush=True)
                table["cpu"] = cpu_ratio(server, bench, "demo", args.quick)
                # The same with the floor's own client: the two then differ from gRPC's floor
                # by attnserve's work alone.
                table["cpu_generic"] = generic_client_rows(
                    args.build, server.proc.pid, server.target, floor_messages, floor_reps,
                    "gRPC's generic client", ("streamed 1-token step", "unary 1x1 Forward"),
                    "demo")
                print("chunked prefill (768-wide, 32 sessions):", flush=True)
                pairs = 1 if args.quick else 5
                table["prefill"] = arrivals_p99(bench, "wide", 2 * steps,
                                                ["--prompt", 4096, "--steps", 1],
                                                "4096-token prompts", pairs)
                table["context"] = arrivals_p99(
                    bench, "wide", 4 * steps,
                    ["--kind", "causal_cross", "--context-random", f"1,{CONTEXT}", "--prompt", 1,
                     "--steps", 1], f"causal cross sessions of {CONTEXT}-token contexts", pairs)
        finally:
            server.stop()


def print_other_rows(table):
    for precision in ("f32", "bf16"):
        for label, name, prompt, how, tps, ceiling, _ in table[f"ceiling_{precision}"]:
            target = ">= 0.6" if name == "wide" else "(per-message cost)"
            print(f"| {name} {precision} cache, prompt {prompt}, {how}: tokens/s / ceiling | "
                  f"{tps:.0f} / {ceiling:.0f} = {tps / ceiling:.3f} | {target} |")
        for prompt, n, tps, ceiling, overlap in table[f"engine_{precision}"]:
            print(f"| wide {precision} cache, prompt {prompt}, Layer::Decode alone (no server), "
                  f"{n} sequences: tokens/s / ceiling | {tps:.0f} / {ceiling:.0f} = "
                  f"{tps / ceiling:.3f} | (as near as a row can come) |")
            print(f"| the same with its projections beside its attention (the --overlap bound) | "
                  f"{tps / ceiling:.3f} x {overlap:.3f} = {tps * overlap / ceiling:.3f} | "
                  f"(as near as overlapping the two could bring it) |")
    for name, prompt, how, tps, ceiling, share, client_cpu in table["shared"]:
        print(f"| {name} f32, prompt {prompt}, {how}: tokens/s / shared-cores ceiling (client "
              f"{client_cpu * 1e6:.0f} us + gRPC floor + memory, per token; medians) | "
              f"{tps:.0f} / {ceiling:.0f}: {share:.3f} | (measured ceiling) |")
    for prompt, session, recompute in table["recompute"]:
        print(f"| session / recompute, 768-wide, prompt {prompt} | "
              f"{session:.0f} / {recompute:.1f} = {session / recompute:.1f}x | "
              f"{'>= 20x' if prompt == 512 else ''} |")
    for client, key in (("the load tester", "cpu"), ("gRPC's generic client", "cpu_generic")):
        for in_flight, (step_cpu, forward_cpu) in table[key].items():
            print(f"| server CPU per streamed 1-token step / per unary 1x1 Forward, {client}, "
                  f"{in_flight} in flight | {step_cpu * 1e6:.1f} us / {forward_cpu * 1e6:.1f} us "
                  f"= {step_cpu / forward_cpu:.2f} | <= 0.6 |")
    for in_flight, (step_cpu, forward_cpu) in table["cpu_generic"].items():
        stream_cpu, unary_cpu = table["floor"][in_flight]
        print(f"| gRPC alone: server CPU per streamed message / per unary call, {in_flight} in "
              f"flight | {stream_cpu * 1e6:.1f} us / {unary_cpu * 1e6:.1f} us = "
              f"{stream_cpu / unary_cpu:.2f} | (floor) |")
        print(f"| attnserve's CPU above gRPC's: per step / per call, {in_flight} in flight | "
              f"{(step_cpu - stream_cpu) * 1e6:.1f} us / {(forward_cpu - unary_cpu) * 1e6:.1f} us "
              f"| (step <= call) |")
    for key, what, target in (("prefill", "4096-token prompts", "<= 2x"),
                              ("context", f"causal cross sessions of {CONTEXT}-token contexts",
                               "(as prompts: <= 2x)")):
        (alone, busy), ratios = table[key]
        print(f"| step p99 of 32 sessions with / without {what} (the median of {len(ratios)} "
              f"pairs; all: {', '.join(f'{r:.2f}' for r in ratios)}) | "
              f"{busy:.2f} / {alone:.2f} ms = {busy / alone:.2f}x | {target} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    parser.add_argument("--skip-4096", action="store_true", help="no cache-length-4096 rows")
    parser.add_argument("--long-sequences", type=int, default=64,
                        help="sequences of the cache-length-4096 rows (each needs a 4096-token "
                             "prefill first)")
    parser.add_argument("--peer-only", action="store_true",
                        help="only the section against the PyTorch KV-cache server")
    args = parser.parse_args()
    server_bin = os.path.join(args.build, "server", "attnserve")
    client_bin = os.path.join(args.build, "client", "attnserve-client")
    steps = 16 if args.quick else 128
    lengths = [(512, 64)] + ([] if args.skip_4096 else [(4096, args.long_sequences)])

    # The peer's workload: the ceiling rows' (prompt 512, 64 sequences, 128 steps); --quick
    # shrinks all three, the PyTorch server's prefill being the long part.
    peer_n, peer_prompt, peer_steps = (16, 128, 64) if args.quick else (64, 512, 128)
    table = {}
    with tempfile.TemporaryDirectory() as workdir:
        layer = os.path.join(workdir, "wide.safetensors")
        write_wide_layer(layer)
        if not args.peer_only:
            other_sections(table, args, server_bin, client_bin, workdir, layer, steps, lengths)
        print("peer: PyTorch KV-cache server (768-wide, f32):", flush=True)
        table["peer"] = peer_rows(server_bin, client_bin, args.build, workdir, layer, peer_n,
                                  peer_prompt, peer_steps, reps=1 if args.quick else 3)

    print("\n| measure | value | target |\n|---|---|---|")
    if not args.peer_only:
        print_other_rows(table)
    for prompt, how, ours, peer, most in table["peer"]:
        print(f"| attnserve / PyTorch KV-cache server tokens/s (medians), 768-wide, prompt "
              f"{prompt}, {peer_steps} steps, {how} | {ours:.0f} / {peer:.0f} = "
              f"{ours / peer:.1f}x | "
              f">= 5x |")
        print(f"| the memory-bound ceiling / the peer's tokens/s (the most any server can be "
              f"ahead), {how} | {most:.1f}x | (measured ceiling) |")


if __name__ == "__main__":
    main()
