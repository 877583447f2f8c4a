#!/usr/bin/python3
"""serving_load.py: serving_load's closed loop from a Python grpcio client (the client the
first serving measurements used), printing the same JSON line. Each caller is a thread making
blocking calls with the request serialized once, as raw bytes through a generic method.

  serving_load.py --target 127.0.0.1:50051 --pid PID --method forward|infer|health --batch 1
                  --seq 16 --callers 8 --seconds 5 [--stubs build/python]
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

import grpc
import numpy as np

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def request_bytes(args):
    """The method's path and its request, the same values as serving_load.cc sends."""
    sys.path.insert(0, args.stubs)
    x = np.random.default_rng(7).standard_normal((args.batch, args.seq, args.width),
                                                 dtype=np.float32)
    if args.method == "infer":
        from inference import grpc_service_pb2 as pb
        request = pb.ModelInferRequest(model_name=args.model)
        request.parameters["kind"].string_param = args.kind
        request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        return "/inference.GRPCInferenceService/ModelInfer", request.SerializeToString()
    from attnserve.v1 import attention_pb2 as pb
    kind = pb.AttentionKind.Value("ATTENTION_KIND_" + args.kind.upper())
    request = pb.ForwardRequest(model=args.model, kind=kind)
    request.input.shape.extend(x.shape)
    request.input.raw = x.tobytes()
    return "/attnserve.v1.AttentionService/Forward", request.SerializeToString()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--pid", type=int, default=0)
    p.add_argument("--method", choices=["health", "forward", "infer"], default="forward")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--kind", default="bidirectional")
    p.add_argument("--model", default="")
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--warmup", type=float, default=1)
    p.add_argument("--stubs", default=os.path.join(os.path.dirname(__file__), "../../build/python"))
    args = p.parse_args()

    if args.method == "health":
        # grpc.health.v1.HealthCheckRequest{} is the empty message: zero bytes on the wire.
        method, body = "/grpc.health.v1.Health/Check", b""
    else:
        method, body = request_bytes(args)
    channel = grpc.insecure_channel(args.target, options=[
        ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
    call = channel.unary_unary(method)  # bytes in, bytes out: no per-call serialization

    measuring = threading.Event()
    stop = threading.Event()
    lock = threading.Lock()
    latencies, codes = [], {}

    def caller():
        mine, my_codes = [], {}
        while not stop.is_set():
            start = time.perf_counter()
            try:
                call(body)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            if measuring.is_set():
                mine.append((time.perf_counter() - start) * 1e3)
                my_codes[code] = my_codes.get(code, 0) + 1
        with lock:
            latencies.extend(mine)
            for k, v in my_codes.items():
                codes[k] = codes.get(k, 0) + v

    threads = [threading.Thread(target=caller) for _ in range(args.callers)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    cpu_before = cpu_seconds(args.pid) if args.pid else 0
    started = time.perf_counter()
    measuring.set()
    time.sleep(args.seconds)
    measuring.clear()
    elapsed = time.perf_counter() - started
    cpu = cpu_seconds(args.pid) - cpu_before if args.pid else 0
    stop.set()
    for t in threads:
        t.join()
    calls = len(latencies)
    ok = codes.get("OK", 0)
    q = statistics.quantiles(latencies, n=100) if calls >= 2 else [0] * 99
    print(json.dumps({
        "method": args.method, "batch": args.batch, "seq": args.seq, "callers": args.callers,
        "calls": calls, "ok": ok, "codes": codes, "calls_per_s": calls / elapsed,
        "ok_per_s": ok / elapsed, "server_cpu_us_per_call": cpu / calls * 1e6 if calls else 0,
        "p50_ms": q[49], "p99_ms": q[98]}))


if __name__ == "__main__":
    main()
