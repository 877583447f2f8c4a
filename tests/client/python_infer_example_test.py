#!/usr/bin/python3
"""ctest driver: runs client/python/infer_example.py (the Open Inference Protocol) against a real
attnserve, then checks that ModelInfer and attnserve.v1 Forward answer the same call with the same
bits, from Python. Ends the server with SIGTERM and expects a clean exit.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_example_test import start_server  # noqa: E402  (the same server start-up)


def check_infer_equals_forward(args, target):
    """ModelInfer on FP32 raw bytes == Forward on the same array, bit for bit."""
    sys.path.insert(0, os.path.dirname(args.example))
    import example
    import infer_example
    import grpc
    v1, v1_grpc = example.load_stubs(args.stubs)
    v2, v2_grpc = infer_example.load_stubs(args.stubs)
    channel = grpc.insecure_channel(target)
    x = np.random.default_rng(7).standard_normal((2, 5, 256)).astype(np.float32)
    lengths = np.array([5, 3], dtype=np.int32)
    forward = example.from_tensor(v1_grpc.AttentionServiceStub(channel).Forward(
        v1.ForwardRequest(model="demo", kind=v1.ATTENTION_KIND_CAUSAL,
                          input=example.to_tensor(v1, x), lengths=lengths.tolist()),
        timeout=30).output)
    infer = infer_example.outputs(v2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
        infer_example.infer_request(v2, "demo", "causal", {"input": x, "lengths": lengths}),
        timeout=30))["output"]
    assert infer.shape == forward.shape and np.array_equal(infer, forward), "ModelInfer == Forward"
    print("ModelInfer == Forward, bit for bit")


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--server", "--stubs", "--example"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        proc, target = start_server(args.server, workdir, ["demo=built-in"])
        try:
            run = subprocess.run([sys.executable, args.example.replace("example.py",
                                                                       "infer_example.py"),
                                  "--target", target, "--model", "demo", "--stubs", args.stubs],
                                 timeout=120)
            assert run.returncode == 0, f"infer_example.py exited {run.returncode}"
            check_infer_equals_forward(args, target)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed"
            print(open(os.path.join(workdir, "server.log")).read()[-2000:])
        assert code == 0, f"attnserve exited {code} on SIGTERM"
    print("ok")


if __name__ == "__main__":
    main()
