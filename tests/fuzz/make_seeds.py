#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora into OUT_DIR/<harness>/ (tests/fuzz/run.sh calls it).

fuzz_safetensors: the weight fixtures of tests/fixtures (every layout, F32/F16/BF16, a prefix).
fuzz_forward_request: a few ForwardRequests for the demo layer (d_model 256), one per kind and
encoding, serialized by protoc from text format, so nothing binary is committed.
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


if __name__ == "__main__":
    main()
