#!/usr/bin/python3
"""Calls attnserve over the Open Inference Protocol's REST form (KServe v2 over HTTP) with the
Python standard library only (urllib, json, struct): no gRPC, no numpy, no generated code.

    python3 client/python/rest_example.py --url http://localhost:8000 --model demo

It checks readiness, reads the model's tensor contract, then makes one causal call twice: as
JSON (nested data, INT32 lengths) and with Triton's binary tensor extension (raw little-endian
bytes after a JSON header, the reply's output in bytes too), and checks that both answers agree.
A bearer token comes from $ATTNSERVE_TOKEN (never the command line, where `ps` shows it); TLS
from an https:// URL (--tls-ca to trust a private CA).
"""
import argparse
import json
import math
import os
import ssl
import struct
import sys
import urllib.error
import urllib.request


def call(url, body=None, headers=None, context=None):
    """(status, headers, body bytes) of one request; errors are answers too."""
    headers = dict(headers or {})
    if os.environ.get("ATTNSERVE_TOKEN"):
        headers["Authorization"] = "Bearer " + os.environ["ATTNSERVE_TOKEN"]
    request = urllib.request.Request(url, data=body, headers=headers,
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tls-ca", help="PEM CA bundle to trust (https:// URLs)")
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else None
    base = f"{args.url}/v2/models/{args.model}"

    status, _, _ = call(f"{args.url}/v2/health/ready", context=context)
    print("ready" if status == 200 else f"not ready ({status})")
    status, _, body = call(base, context=context)
    if status != 200:
        sys.exit(f"model metadata: {status} {body.decode()}")
    metadata = json.loads(body)
    width = metadata["inputs"][0]["shape"][-1]  # d_model
    print(f"{metadata['name']}: inputs {[t['name'] for t in metadata['inputs']]}, d_model {width}")

    # Two sequences of 4 and 3 tokens, padded to [2, 4, d_model].
    batch, seq = 2, 4
    values = [math.sin(0.1 * i) for i in range(batch * seq * width)]
    nested = [[values[(b * seq + s) * width:(b * seq + s + 1) * width] for s in range(seq)]
              for b in range(batch)]
    request = {"id": "json-call", "parameters": {"kind": "causal"},
               "inputs": [{"name": "input", "datatype": "FP32", "shape": [batch, seq, width],
                           "data": nested},
                          {"name": "lengths", "datatype": "INT32", "shape": [batch],
                           "data": [4, 3]}]}
    status, _, body = call(f"{base}/infer", json.dumps(request).encode(),
                           {"Content-Type": "application/json"}, context)
    if status != 200:
        sys.exit(f"JSON infer: {status} {body.decode()}")
    output = json.loads(body)["outputs"][0]
    print(f"JSON:   output {output['shape']}, first values {output['data'][:3]}")

    # The same call with the tensors as bytes: a JSON header, then the inputs in order.
    raw = struct.pack(f"<{len(values)}f", *values) + struct.pack("<2i", 4, 3)
    header = {"id": "binary-call", "parameters": {"kind": "causal", "binary_data_output": True},
              "inputs": [{"name": "input", "datatype": "FP32", "shape": [batch, seq, width],
                          "parameters": {"binary_data_size": len(values) * 4}},
                         {"name": "lengths", "datatype": "INT32", "shape": [batch],
                          "parameters": {"binary_data_size": 8}}]}
    header_bytes = json.dumps(header).encode()
    status, headers, body = call(
        f"{base}/infer", header_bytes + raw,
        {"Content-Type": "application/octet-stream",
         "Inference-Header-Content-Length": str(len(header_bytes))}, context)
    if status != 200:
        sys.exit(f"binary infer: {status} {body.decode(errors='replace')}")
    json_length = int(headers["Inference-Header-Content-Length"])
    reply = json.loads(body[:json_length])
    size = reply["outputs"][0]["parameters"]["binary_data_size"]
    binary_output = struct.unpack(f"<{size // 4}f", body[json_length:json_length + size])
    print(f"binary: output {reply['outputs'][0]['shape']}, first values "
          f"{[round(v, 7) for v in binary_output[:3]]}")
    # JSON numbers are the shortest text that reads back as the float32: read them as float32.
    as_float32 = struct.unpack(f"<{len(output['data'])}f",
                               struct.pack(f"<{len(output['data'])}f", *output["data"]))
    same = as_float32 == binary_output
    print("JSON and binary answers are the same float32 values" if same else
          "JSON and binary answers differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
