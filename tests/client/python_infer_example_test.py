#!/usr/bin/python3
"""ctest driver: runs client/python/infer_example.py (the Open Inference Protocol) against a real
attnserve, then checks that ModelInfer and attnserve.v1 Forward answer the same call with the same
bits, from Python. Ends the server with SIGTERM and expects a clean exit.
Then runs the example again against a server with mutual TLS and bearer tokens (certificates made
by openssl here, as python_example_test.py does): answered with the client certificate and the
token (from ATTNSERVE_TOKEN, then from --token), UNAUTHENTICATED without the token, refused
without the client certificate.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_example_test import make_certificates, start_server  # noqa: E402  (the same helpers)


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


def make_client_certificate(workdir):
    """A client certificate signed by make_certificates' CA (ca.pem, ca.key in workdir)."""
    def openssl(*argv):
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=workdir)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr",
            "-subj", "/CN=attnserve-test-client")
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "client.pem", "-days", "1")
    return os.path.join(workdir, "client.pem"), os.path.join(workdir, "client.key")


def check_example_over_mtls_with_token(args, example, workdir):
    """infer_example.py --tls-ca/--tls-cert/--tls-key with a token against mTLS + tokens."""
    ca, cert, key = make_certificates(workdir)
    client_cert, client_key = make_client_certificate(workdir)
    tokens = os.path.join(workdir, "tokens")
    with open(tokens, "w") as f:
        f.write("infer-token-1\n")
    proc, target = start_server(args.server, workdir, ["demo=built-in"], [
        "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca,
        "--auth-token-file", tokens], name="mtls")
    target = target.replace("127.0.0.1", "localhost")  # the name the certificate holds
    base = [sys.executable, example, "--target", target, "--model", "demo", "--stubs", args.stubs,
            "--tls-ca", ca]
    mtls = base + ["--tls-cert", client_cert, "--tls-key", client_key]
    env = {k: v for k, v in os.environ.items() if k != "ATTNSERVE_TOKEN"}

    def run(argv, token_env=None):
        run_env = dict(env, ATTNSERVE_TOKEN=token_env) if token_env else env
        return subprocess.run(argv, env=run_env, timeout=120, capture_output=True, text=True)
    try:
        done = run(mtls, token_env="infer-token-1")
        assert done.returncode == 0, f"with ATTNSERVE_TOKEN: exit {done.returncode}\n" + \
            done.stdout[-2000:] + done.stderr[-2000:]
        done = run(mtls + ["--token", "infer-token-1"])
        assert done.returncode == 0, f"with --token: exit {done.returncode}\n" + done.stderr[-2000:]
        done = run(mtls)
        assert done.returncode != 0 and "UNAUTHENTICATED" in done.stderr, done.stderr[-2000:]
        done = run(base + ["--token", "infer-token-1"])
        assert done.returncode != 0 and "UNAVAILABLE" in done.stderr, done.stderr[-2000:]
        print("infer_example.py over mTLS: answered with the token (ATTNSERVE_TOKEN or --token),"
              " UNAUTHENTICATED without it, UNAVAILABLE without the client certificate")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--server", "--stubs", "--example"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    example = os.path.join(os.path.dirname(args.example), "infer_example.py")
    with tempfile.TemporaryDirectory() as workdir:
        proc, target = start_server(args.server, workdir, ["demo=built-in"])
        try:
            run = subprocess.run([sys.executable, example, "--target", target, "--model", "demo",
                                  "--stubs", args.stubs], timeout=120)
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
        check_example_over_mtls_with_token(args, example, workdir)
    print("ok")


if __name__ == "__main__":
    main()
