#!/usr/bin/python3
"""Calls attnserve from Python: padded, packed and cross attention, numpy in and out.

Needs Debian's python3-grpcio and python3-numpy (run it with /usr/bin/python3) and the stubs
that the CMake build generates into build/python:

    /usr/bin/python3 client/python/example.py --target localhost:50051

With TLS (trusting a CA; mTLS adds a client certificate) and a bearer token, which is better
given through the environment than on the command line, where `ps` shows it:

    ATTNSERVE_TOKEN=... /usr/bin/python3 client/python/example.py --target server.example:50051 \
        --tls-ca ca.pem [--tls-cert client.pem --tls-key client.key]

The stub directory comes from --stubs, else $ATTNSERVE_PY_STUBS, else ../../build/python
relative to this file.
"""
import argparse
import json
import os
import sys

import numpy as np


# Forward and ListModels are pure functions of their request: a call cut off with its replica is
# safe to send again, to another one (the README's service config, as the C++ client uses).
RETRY_SERVICE_CONFIG = {"methodConfig": [{
    "name": [{"service": "attnserve.v1.AttentionService", "method": "Forward"},
             {"service": "attnserve.v1.AttentionService", "method": "ListModels"}],
    "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}


def load_stubs(stubs_dir):
    """Imports the generated attention_pb2 modules from stubs_dir."""
    sys.path.insert(0, stubs_dir)
    try:
        from attnserve.v1 import attention_pb2, attention_pb2_grpc
    except ImportError as e:
        sys.exit(f"cannot import the generated stubs from {stubs_dir} ({e}): build the project "
                 "first (deploy/build.sh) or pass --stubs DIR")
    return attention_pb2, attention_pb2_grpc


def to_tensor(pb, array):
    """numpy -> Tensor, as little-endian float32 bytes (the fast encoding)."""
    array = np.ascontiguousarray(array, dtype="<f4")
    return pb.Tensor(shape=array.shape, raw=array.tobytes())


def from_tensor(tensor):
    """Tensor -> numpy; the server answers in the encoding the request used."""
    if tensor.raw:
        return np.frombuffer(tensor.raw, dtype="<f4").reshape(tuple(tensor.shape))
    return np.array(tensor.values, dtype=np.float32).reshape(tuple(tensor.shape))


def open_channel(grpc, args):
    """A plaintext channel, or TLS when --tls-ca is given (mTLS with --tls-cert/--tls-key)."""
    # gRPC's 4 MiB default receive limit would refuse most answers; UNAVAILABLE (a replica
    # that died mid-call) is retried, as the README's service config says.
    options = [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.service_config", json.dumps(RETRY_SERVICE_CONFIG)),
        ("grpc.per_rpc_retry_buffer_size", 256 << 20)]
    if not args.tls_ca:
        return grpc.insecure_channel(args.target, options=options)

    def read(path):
        return open(path, "rb").read() if path else None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca), private_key=read(args.tls_key),
        certificate_chain=read(args.tls_cert))
    return grpc.secure_channel(args.target, credentials, options=options)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051")
    parser.add_argument("--model", default="", help="model name (default: the first one)")
    parser.add_argument("--stubs", default=os.environ.get(
        "ATTNSERVE_PY_STUBS", os.path.join(here, "..", "..", "build", "python")))
    parser.add_argument("--tls-ca", help="PEM CA bundle: connect with TLS, trusting it")
    parser.add_argument("--tls-cert", help="PEM client certificate, for mTLS")
    parser.add_argument("--tls-key", help="PEM client key, for mTLS")
    parser.add_argument("--token", default=os.environ.get("ATTNSERVE_TOKEN", ""),
                        help="bearer token (default: $ATTNSERVE_TOKEN)")
    args = parser.parse_args()

    import grpc
    pb, pb_grpc = load_stubs(args.stubs)
    channel = open_channel(grpc, args)
    stub = pb_grpc.AttentionServiceStub(channel)
    # Every call carries the deadline and, when there is one, the token.
    call = {"timeout": 30}
    if args.token:
        call["metadata"] = [("authorization", f"Bearer {args.token}")]

    # Which model, and its widths.
    models = stub.ListModels(pb.ListModelsRequest(), **call).models
    model = next((m for m in models if m.name == args.model or not args.model), None)
    if model is None:
        sys.exit(f"no model {args.model!r}; the server has {[m.name for m in models]}")
    print(f"model {model.name}: d_model {model.d_model}, {model.num_heads} heads, {model.layout}")
    rng = np.random.default_rng(0)
    lengths = [6, 2, 4]
    x = rng.standard_normal((3, 6, model.d_model), dtype=np.float32)

    # 1. Padded: [B, S, d] with lengths; rows past a length are padding (masked, output 0).
    if pb.ATTENTION_KIND_CAUSAL in model.kinds:
        padded = from_tensor(stub.Forward(pb.ForwardRequest(
            model=model.name, kind=pb.ATTENTION_KIND_CAUSAL, input=to_tensor(pb, x),
            lengths=lengths), **call).output)
        print("padded causal output", padded.shape)
        assert not padded[1, 2:].any(), "padded rows of the output are zero"

        # 2. Packed: the same sequences back to back, [sum(lengths), d], no padding on the wire.
        x_packed = np.concatenate([x[b, :n] for b, n in enumerate(lengths)])
        packed = from_tensor(stub.Forward(pb.ForwardRequest(
            model=model.name, kind=pb.ATTENTION_KIND_CAUSAL, input=to_tensor(pb, x_packed),
            lengths=lengths), **call).output)
        print("packed causal output", packed.shape)
        padded_valid = np.concatenate([padded[b, :n] for b, n in enumerate(lengths)])
        assert np.allclose(padded_valid, packed, atol=1e-5), "padded and packed calls agree"

    # 3. Cross: queries from x, keys and values from a context; a context of length 0 is fine.
    context = rng.standard_normal((3, 9, model.d_context), dtype=np.float32)
    reply = stub.Forward(pb.ForwardRequest(
        model=model.name, kind=pb.ATTENTION_KIND_CROSS, input=to_tensor(pb, x), lengths=lengths,
        context=to_tensor(pb, context), context_lengths=[9, 5, 0], return_attention=True),
        **call)
    output, attention = from_tensor(reply.output), from_tensor(reply.attention)
    print("cross output", output.shape, "attention", attention.shape)
    assert np.allclose(attention[1, :, :2].sum(-1), 1, atol=1e-5), "valid rows sum to 1"
    assert not attention[1, :, :, 5:].any(), "keys past the context length get nothing"
    assert not attention[2].any(), "an empty context is attended by nobody"

    # Errors come back as gRPC status codes.
    try:
        stub.Forward(pb.ForwardRequest(model="no-such-model", kind=pb.ATTENTION_KIND_CAUSAL,
                                       input=to_tensor(pb, x)), **call)
        raise AssertionError("an unknown model must fail")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        print("unknown model ->", e.code().name)
    print("ok")


if __name__ == "__main__":
    main()
