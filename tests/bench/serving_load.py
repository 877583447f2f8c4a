#!/usr/bin/python3
"""Drives one gRPC method of a server with N concurrent callers for a fixed time and prints one
JSON line: calls/s, latency percentiles, status codes, and the server's CPU per call (from
/proc/PID/stat, steadier than wall time on a shared machine).

Requests are serialized once and sent as bytes, so the client costs as little per call as
grpcio allows and is the same for every server and method it drives.

  serving_load.py --target 127.0.0.1:50051 --pid PID --method forward --batch 1 --seq 16 \\
      --callers 8 --seconds 5 [--stubs build/python] [--model demo] [--kind bidirectional]
"""
import argparse
import asyncio
import json
import os
import sys
import time

import grpc
import numpy as np

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def forward_bytes(args):
    sys.path.insert(0, args.stubs)
    from attnserve.v1 import attention_pb2 as pb

    rng = np.random.default_rng(7)
    width = args.width
    x = rng.standard_normal((args.batch, args.seq, width), dtype=np.float32)
    request = pb.ForwardRequest(model=args.model, kind=pb.AttentionKind.Value(
        "ATTENTION_KIND_" + args.kind.upper()))
    request.input.shape.extend(x.shape)
    request.input.raw = x.astype("<f4").tobytes()
    return request.SerializeToString()


async def run(args):
    if args.method == "health":
        method, body = "/grpc.health.v1.Health/Check", b""
    else:
        method, body = "/attnserve.v1.AttentionService/Forward", forward_bytes(args)
    options = [("grpc.max_receive_message_length", 256 << 20),
               ("grpc.max_send_message_length", 256 << 20)]
    async with grpc.aio.insecure_channel(args.target, options=options) as channel:
        call = channel.unary_unary(method)
        codes = {}
        latencies = []
        state = {"measuring": False, "stop": False}

        async def caller():
            while not state["stop"]:
                start = time.perf_counter()
                try:
                    await call(body, timeout=args.timeout)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                if state["measuring"]:
                    latencies.append(time.perf_counter() - start)
                    codes[code] = codes.get(code, 0) + 1

        tasks = [asyncio.create_task(caller()) for _ in range(args.callers)]
        await asyncio.sleep(args.warmup)
        cpu0 = cpu_seconds(args.pid) if args.pid else 0.0
        t0 = time.perf_counter()
        state["measuring"] = True
        await asyncio.sleep(args.seconds)
        state["measuring"] = False
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_seconds(args.pid) if args.pid else 0.0
        state["stop"] = True
        await asyncio.gather(*tasks)
    ok = codes.get("OK", 0)
    lat = np.array(sorted(latencies)) * 1e3 if latencies else np.zeros(1)
    print(json.dumps({
        "method": args.method, "batch": args.batch, "seq": args.seq, "callers": args.callers,
        "calls": sum(codes.values()), "ok": ok, "codes": codes,
        "calls_per_s": sum(codes.values()) / elapsed, "ok_per_s": ok / elapsed,
        "server_cpu_us_per_call": (cpu1 - cpu0) / max(sum(codes.values()), 1) * 1e6,
        "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
    }))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--pid", type=int, default=0, help="server process for CPU per call")
    p.add_argument("--method", choices=["health", "forward"], default="forward")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--width", type=int, default=256, help="d_model of the model")
    p.add_argument("--kind", default="bidirectional")
    p.add_argument("--model", default="")
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--stubs", default=os.path.join(os.path.dirname(__file__), "../../build/python"))
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
