#!/usr/bin/python3
"""Calls attnserve over the Open Inference Protocol (KServe v2, inference.GRPCInferenceService),
the protocol Triton's and KServe's clients speak, with stubs generated from our
proto/inference/grpc_service.proto; numpy in and out.

Needs Debian's python3-grpcio and python3-numpy (run it with /usr/bin/python3) and the stubs
that the CMake build generates into build/python:

    /usr/bin/python3 client/python/infer_example.py --target localhost:50051 --model demo

With TLS (trusting a CA; mTLS adds a client certificate) and a bearer token, which is better
given through the environment than on the command line, where `ps` shows it (the same flags as
example.py):

    ATTNSERVE_TOKEN=... /usr/bin/python3 client/python/infer_example.py \
        --target server.example:50051 --tls-ca ca.pem [--tls-cert client.pem --tls-key client.key]

The stub directory comes from --stubs, else $ATTNSERVE_PY_STUBS, else ../../build/python
relative to this file.
"""
import argparse
import os
import sys

import numpy as np


def load_stubs(stubs_dir):
    """Imports the generated grpc_service_pb2 modules from stubs_dir."""
    sys.path.insert(0, stubs_dir)
    try:
        from inference import grpc_service_pb2, grpc_service_pb2_grpc
    except ImportError as e:
        sys.exit(f"cannot import the generated stubs from {stubs_dir} ({e}): build the project "
                 "first (deploy/build.sh) or pass --stubs DIR")
    return grpc_service_pb2, grpc_service_pb2_grpc


def infer_request(pb, model, kind, inputs, return_attention=False, raw=True, request_id=""):
    """A ModelInferRequest: `inputs` maps tensor names to numpy arrays (float16/float32 for
    input and context, int32 for the lengths); raw bytes (Triton's way) or typed contents."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["kind"].string_param = kind
    request.parameters["return_attention"].bool_param = return_attention
    for name, array in inputs.items():
        datatype = {np.float32: "FP32", np.float16: "FP16", np.int32: "INT32"}[array.dtype.type]
        tensor = request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            little_endian = array.astype(array.dtype.newbyteorder("<"), copy=False)
            request.raw_input_contents.append(little_endian.tobytes())  # row-major
        elif datatype == "INT32":
            tensor.contents.int_contents.extend(array.ravel().tolist())
        else:
            tensor.contents.fp32_contents.extend(array.ravel().tolist())
    return request


def outputs(response):
    """The response's outputs as {name: float32 array}, whichever encoding it came in."""
    result = {}
    for i, tensor in enumerate(response.outputs):
        if response.raw_output_contents:
            data = np.frombuffer(response.raw_output_contents[i], dtype="<f4")
        else:
            data = np.array(tensor.contents.fp32_contents, dtype=np.float32)
        result[tensor.name] = data.reshape(tuple(tensor.shape))
    return result


def open_channel(grpc, args):
    """A plaintext channel, or TLS when --tls-ca is given (mTLS with --tls-cert/--tls-key)."""
    # gRPC's 4 MiB default receive limit would refuse most answers.
    options = [("grpc.max_receive_message_length", 256 << 20),
               ("grpc.max_send_message_length", 256 << 20)]
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
    parser.add_argument("--model", default="demo")
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
    stub = pb_grpc.GRPCInferenceServiceStub(open_channel(grpc, args))
    # Every call carries the deadline and, when there is one, the token.
    call = {"timeout": 30}
    if args.token:
        call["metadata"] = [("authorization", f"Bearer {args.token}")]

    server = stub.ServerMetadata(pb.ServerMetadataRequest(), **call)
    print(f"server {server.name} {server.version}, extensions {list(server.extensions)}")
    assert stub.ServerReady(pb.ServerReadyRequest(), **call).ready
    metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name=args.model), **call)
    for tensor in list(metadata.inputs) + list(metadata.outputs):
        print(f"  {tensor.name:16s} {tensor.datatype:5s} {list(tensor.shape)}")
    d_model = metadata.inputs[0].shape[-1]
    d_context = metadata.inputs[2].shape[-1]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 6, d_model), dtype=np.float32)
    lengths = np.array([6, 2, 4], dtype=np.int32)

    # 1. Causal, padded [B, S, d] with lengths, raw bytes: the answer comes as raw bytes.
    reply = stub.ModelInfer(infer_request(pb, args.model, "causal",
                                          {"input": x, "lengths": lengths}, request_id="a"),
                            **call)
    causal = outputs(reply)["output"]
    print("causal output", causal.shape, "id", reply.id)
    assert reply.id == "a" and not causal[1, 2:].any(), "padded rows of the output are zero"

    # 2. The same in FP16 (half the bytes on the wire), answered in FP32.
    half = outputs(stub.ModelInfer(infer_request(
        pb, args.model, "causal", {"input": x.astype(np.float16), "lengths": lengths}),
        **call))["output"]
    print("fp16 input: largest difference to fp32", float(abs(half - causal).max()))
    assert half.dtype == np.float32 and np.allclose(half, causal, atol=2e-2)

    # 3. Cross attention, packed [T, d] input, typed contents, only the attention asked for.
    packed = np.concatenate([x[b, :n] for b, n in enumerate(lengths)])
    context = rng.standard_normal((3, 9, d_context), dtype=np.float32)
    request = infer_request(pb, args.model, "cross",
                            {"input": packed, "lengths": lengths, "context": context,
                             "context_lengths": np.array([9, 5, 0], dtype=np.int32)},
                            raw=False)
    request.outputs.add(name="attention")
    attention = outputs(stub.ModelInfer(request, **call))["attention"]
    print("cross attention", attention.shape)
    assert np.allclose(attention[1, :, :2].sum(-1), 1, atol=1e-5), "valid rows sum to 1"

    # Errors come back as gRPC status codes.
    try:
        stub.ModelInfer(infer_request(pb, "no-such-model", "causal", {"input": x}), **call)
        raise AssertionError("an unknown model must fail")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        print("unknown model ->", e.code().name)
    print("ok")


if __name__ == "__main__":
    main()
