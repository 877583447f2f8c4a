#!/usr/bin/python3
"""ctest driver: runs client/python/example.py against a real attnserve, then checks that
attnserve-client's .npy files and a Python gRPC call agree on the same data (numpy writes the
input file, numpy reads the output file). Ends the server with SIGTERM and expects a clean exit.
Then runs the example again against a TLS server that asks for a bearer token (certificates made
by openssl here), with the token from ATTNSERVE_TOKEN, and checks that without it the call fails.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


def save_numpy_layer(example, path):
    """A torch.nn.MultiheadAttention-shaped state_dict made with numpy, saved by save_layer.py."""
    sys.path.insert(0, os.path.dirname(example))
    from save_layer import save_layer
    rng = np.random.default_rng(5)
    d = 8
    save_layer(path, {"in_proj_weight": rng.standard_normal((3 * d, d)),
                      "in_proj_bias": rng.standard_normal(3 * d),
                      "out_proj.weight": rng.standard_normal((d, d)),
                      "out_proj.bias": rng.standard_normal(d)}, num_heads=2)


def make_certificates(workdir):
    """A CA and a server certificate for localhost signed by it; returns (ca, cert, key)."""
    def openssl(*argv):
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=workdir)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "1", "-subj", "/CN=attnserve-test-ca")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")
    with open(os.path.join(workdir, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.ext")
    return [os.path.join(workdir, n) for n in ("ca.pem", "server.pem", "server.key")]


def check_example_over_tls_with_token(args, workdir):
    """example.py --tls-ca with ATTNSERVE_TOKEN against a TLS server with tokens."""
    ca, cert, key = make_certificates(workdir)
    tokens = os.path.join(workdir, "tokens")
    with open(tokens, "w") as f:
        f.write("example-token-1\n")
    proc, target = start_server(args.server, workdir, ["demo=built-in"], [
        "--tls-cert", cert, "--tls-key", key, "--auth-token-file", tokens], name="tls")
    target = target.replace("127.0.0.1", "localhost")  # the name the certificate holds
    try:
        example = [sys.executable, args.example, "--target", target, "--model", "demo",
                   "--stubs", args.stubs, "--tls-ca", ca]
        env = dict(os.environ, ATTNSERVE_TOKEN="example-token-1")
        run = subprocess.run(example, env=env, timeout=120)
        assert run.returncode == 0, f"example.py over TLS with a token exited {run.returncode}"
        env.pop("ATTNSERVE_TOKEN")
        run = subprocess.run(example, env=env, timeout=120, capture_output=True, text=True)
        assert run.returncode != 0 and "UNAUTHENTICATED" in run.stderr, run.stderr[-2000:]
        print("example.py over TLS: answered with the token, UNAUTHENTICATED without")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def start_server(server, workdir, models, extra=(), name="server"):
    """Starts attnserve on a free loopback port; returns (process, "127.0.0.1:PORT")."""
    port_file = os.path.join(workdir, f"{name}.port")
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    flags = [f"--model={m}" for m in models] + list(extra)
    proc = subprocess.Popen([server, "--listen", "127.0.0.1:0", "--port-file", port_file,
                             "--threads", "2", "--metrics-listen=off"] + flags, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"attnserve exited at start:\n{open(log.name).read()}")
        port = open(port_file).read() if os.path.exists(port_file) else ""
        if port.endswith("\n"):  # complete: the server writes "PORT\n"
            return proc, "127.0.0.1:" + port.strip()
        time.sleep(0.05)
    proc.kill()
    sys.exit("attnserve wrote no port in 60 s")


def check_cli_files_match_python(args, target, workdir):
    """attnserve-client infer on a numpy-written file == the same call from Python."""
    sys.path.insert(0, os.path.dirname(args.example))
    import example  # the helpers of the example itself
    import grpc
    pb, pb_grpc = example.load_stubs(args.stubs)
    x = np.random.default_rng(3).standard_normal((2, 5, 256)).astype(np.float32)
    in_path, out_path = os.path.join(workdir, "in.npy"), os.path.join(workdir, "out.npy")
    np.save(in_path, x)
    run = subprocess.run([args.client, "--target", target, "infer", "--model", "demo",
                          "--kind", "causal",
                          "--input", in_path, "--lengths", "5,3", "--output", out_path],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    from_cli = np.load(out_path)
    stub = pb_grpc.AttentionServiceStub(grpc.insecure_channel(target))
    from_python = example.from_tensor(stub.Forward(pb.ForwardRequest(
        model="demo", kind=pb.ATTENTION_KIND_CAUSAL, input=example.to_tensor(pb, x),
        lengths=[5, 3]),
        timeout=30).output)
    assert from_cli.dtype == np.float32 and from_cli.shape == (2, 5, 256), from_cli.shape
    assert np.allclose(from_cli, from_python, atol=1e-6), abs(from_cli - from_python).max()
    print("attnserve-client .npy output == Python call")
    saved = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models}["saved"]
    assert (saved.d_model, saved.num_heads, saved.head_dim) == (8, 2, 4), saved
    assert saved.has_bias and saved.has_output_projection, saved
    print("save_layer.py wrote a file the server loads:", saved.layout)


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--server", "--client", "--stubs", "--example"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        layer = os.path.join(workdir, "saved.safetensors")
        save_numpy_layer(args.example, layer)
        proc, target = start_server(args.server, workdir, ["demo=built-in", f"saved={layer}"])
        try:
            run = subprocess.run([sys.executable, args.example, "--target", target,
                                  "--model", "demo", "--stubs", args.stubs], timeout=120)
            assert run.returncode == 0, f"example.py exited {run.returncode}"
            check_cli_files_match_python(args, target, workdir)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed"
            print(open(os.path.join(workdir, "server.log")).read()[-2000:])
        assert code == 0, f"attnserve exited {code} on SIGTERM"
        check_example_over_tls_with_token(args, workdir)
    print("ok")


if __name__ == "__main__":
    main()
