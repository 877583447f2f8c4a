#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora into OUT_DIR/<harness>/ (tests/fuzz/run.sh calls it).

fuzz_safetensors: the weight fixtures of tests/fixtures (every layout, F32/F16/BF16, a prefix).
fuzz_forward_request: a few ForwardRequests for the demo layer (d_model 256), one per kind and
encoding, serialized by protoc from text format, so nothing binary is committed.
fuzz_http_infer: REST inference bodies for the demo layer (a mode byte, two length bytes, then
the body: JSON nested and flat, lengths, context, binary FP32/FP16 and binary INT32 lengths).
usage: make_seeds.py OUT_DIR
"""
import pathlib
import shutil
import struct
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
D_MODEL = 256  # the demo layer's


def values(rows, offset=0.0):
    return ", ".join(f"{((i * 7) % 13 - 6) / 8 + offset:g}" for i in range(rows * D_MODEL))


def raw(rows):
    data = struct.pack(f"<{rows * D_MODEL}f", *[((i * 5) % 11 - 5) / 4 for i in range(rows * D_MODEL)])
    return "".join(f"\\x{b:02x}" for b in data)


REQUESTS = {
    "padded_bidirectional": f"""kind: ATTENTION_KIND_BIDIRECTIONAL
        input {{ shape: [2, 2, {D_MODEL}] values: [{values(4)}] }} lengths: [2, 1]""",
    "packed_causal_raw": f"""kind: ATTENTION_KIND_CAUSAL
        input {{ shape: [3, {D_MODEL}] raw: "{raw(3)}" }} lengths: [2, 1]""",
    "cross_attention": f"""kind: ATTENTION_KIND_CROSS return_attention: true
        input {{ shape: [1, 2, {D_MODEL}] values: [{values(2)}] }}
        context {{ shape: [1, 3, {D_MODEL}] values: [{values(3, 0.5)}] }} context_lengths: [2]""",
    "causal_cross_packed_raw": f"""kind: ATTENTION_KIND_CAUSAL_CROSS model: "demo"
        input {{ shape: [2, {D_MODEL}] raw: "{raw(2)}" }} lengths: [1, 1]
        context {{ shape: [3, {D_MODEL}] raw: "{raw(3)}" }} context_lengths: [0, 3]""",
    "refused_no_kind": f"""input {{ shape: [1, {D_MODEL}] values: [{values(1)}] }}""",
}


def json_values(rows, offset=0.0):
    return "[" + values(rows, offset) + "]"


def http_bodies():
    """Name -> the harness's input: mode byte, JSON length (2 bytes), body."""
    flat = (f'{{"id":"a","inputs":[{{"name":"input","datatype":"FP32","shape":[1,2,{D_MODEL}],'
            f'"data":{json_values(2)}}}]}}')
    nested_rows = ",".join(json_values(1, r / 4) for r in range(2))
    nested = (f'{{"parameters":{{"kind":"causal","return_attention":true}},"inputs":[{{"name":'
              f'"input","datatype":"FP32","shape":[2,1,{D_MODEL}],"data":[{nested_rows}]}},'
              f'{{"name":"lengths","datatype":"INT32","shape":[2],"data":[1,1]}}]}}')
    cross = (f'{{"parameters":{{"kind":"cross"}},"outputs":[{{"name":"output"}}],"inputs":['
             f'{{"name":"input","datatype":"FP32","shape":[1,{D_MODEL}],"data":{json_values(1)}}},'
             f'{{"name":"context","datatype":"FP32","shape":[2,{D_MODEL}],"data":'
             f'{json_values(2, 0.5)}}},{{"name":"context_lengths","datatype":"INT32","shape":[1],'
             f'"data":[2]}}]}}')
    floats = struct.pack(f"<{2 * D_MODEL}f", *[((i * 5) % 11 - 5) / 4 for i in range(2 * D_MODEL)])
    halves = struct.pack(f"<{D_MODEL}e", *[((i * 3) % 7 - 3) / 4 for i in range(D_MODEL)])
    lengths = struct.pack("<2i", 1, 1)
    header = (f'{{"parameters":{{"binary_data_output":true}},"inputs":[{{"name":"input",'
              f'"datatype":"FP32","shape":[2,{D_MODEL}],"parameters":{{"binary_data_size":'
              f'{len(floats)}}}}},{{"name":"lengths","datatype":"INT32","shape":[2],'
              f'"parameters":{{"binary_data_size":8}}}}]}}')
    half_header = (f'{{"inputs":[{{"name":"input","datatype":"FP16","shape":[1,1,{D_MODEL}],'
                   f'"parameters":{{"binary_data_size":{len(halves)}}}}}]}}')
    pack = lambda mode, text, tail=b"": (bytes([mode]) + struct.pack("<H", len(text)) +
                                         text.encode() + tail)
    return {
        "json_flat": pack(0, flat),
        "json_nested_lengths": pack(0, nested),
        "json_cross_unpadded": pack(2, cross),
        "binary_fp32_lengths": pack(1, header, floats + lengths),
        "binary_fp16": pack(1, half_header, halves),
    }


def main():
    out = pathlib.Path(sys.argv[1])
    tensors = out / "fuzz_safetensors"
    tensors.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "tests/fixtures").glob("w_*.safetensors")):
        if path.stat().st_size <= 16384:  # run.sh's -max_len for this harness
            shutil.copy(path, tensors / path.name)
    requests = out / "fuzz_forward_request"
    requests.mkdir(parents=True, exist_ok=True)
    proto_dir = ROOT / "proto"
    for name, text in REQUESTS.items():
        encoded = subprocess.run(
            ["protoc", f"-I{proto_dir}", "--encode=attnserve.v1.ForwardRequest",
             "attnserve/v1/attention.proto"],
            input=text.encode(), capture_output=True, check=True).stdout
        (requests / name).write_bytes(encoded)
    bodies = out / "fuzz_http_infer"
    bodies.mkdir(parents=True, exist_ok=True)
    for name, data in http_bodies().items():
        (bodies / name).write_bytes(data)


if __name__ == "__main__":
    main()
