#!/usr/bin/python3
"""Generates with an attnserve decode session, and survives the replica dying mid-generation.

A session (one Decode stream) keeps the keys and values of every token it was sent: each step
sends only the new token and gets its output back. This example opens a session, sends a prompt,
then feeds each output row back as the next input for --steps steps. The server's cache lives
only as long as the stream, so when the stream breaks (UNAVAILABLE: the replica died, or was
drained) the example opens a new stream, on whichever replica the channel reaches, replays its
own prefix (every input it has sent, in one message) and goes on: a sequence is never lost with
its replica, and the outputs are those of an unbroken run.

Needs Debian's python3-grpcio and python3-numpy (/usr/bin/python3) and the stubs the build
generates into build/python (as example.py):

    /usr/bin/python3 client/python/decode_example.py --target localhost:50051 --steps 64

Several replicas without a load balancer: a static list and round robin, e.g.
--target ipv4:10.0.0.1:50051,10.0.0.2:50051 --lb-policy round_robin (a stream stays on the
replica it started on; a new one goes to a replica that is up). TLS and the token as example.py.
"""
import argparse
import json
import os
import queue
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example import from_tensor, load_stubs, to_tensor  # noqa: E402


class StreamBroken(Exception):
    """The stream ended under the session: its cache is gone, the prefix must be replayed."""


class DecodeSession:
    """One Decode stream: send a message, read its answer, in lock-step."""

    def __init__(self, stub, metadata):
        self._requests = queue.Queue()
        # wait_for_ready: a new stream waits for a replica (one restarting on the same address,
        # or another of the list) instead of failing at once while none is up.
        self._responses = stub.Decode(iter(self._requests.get, None), metadata=metadata,
                                      wait_for_ready=True)

    def step(self, grpc, request):
        """Sends one message; returns its DecodeResponse, or raises StreamBroken / RuntimeError."""
        self._requests.put(request)
        try:
            response = next(self._responses)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise StreamBroken(f"{e.code().name}: {e.details()}") from e
            raise RuntimeError(f"the session ended: {e.code().name}: {e.details()}") from e
        except StopIteration as e:  # the server ended the stream cleanly (drain)
            raise StreamBroken("the server ended the stream") from e
        if response.error_code != 0:  # refused in the stream: the session is unchanged
            raise RuntimeError(f"step refused (code {response.error_code}): "
                               f"{response.error_message}")
        return response

    def close(self):
        self._requests.put(None)
        self._responses.cancel()


def open_channel(grpc, args):
    """Plaintext or TLS, as example.py; --lb-policy spreads streams over a list of replicas."""
    options = [("grpc.max_receive_message_length", 256 << 20),
               ("grpc.max_send_message_length", 256 << 20),
               # Reconnect to a replica that comes back within a second or so, not minutes.
               ("grpc.initial_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if args.lb_policy:
        options.append(("grpc.service_config",
                        json.dumps({"loadBalancingConfig": [{args.lb_policy: {}}]})))
    if not args.tls_ca:
        return grpc.insecure_channel(args.target, options=options)

    def read(path):
        return open(path, "rb").read() if path else None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(args.tls_ca), private_key=read(args.tls_key),
        certificate_chain=read(args.tls_cert))
    return grpc.secure_channel(args.target, credentials, options=options)


def generate(grpc, pb, stub, args, model, metadata):
    """The prompt, then --steps outputs each fed back; returns the generated rows [steps, d]."""
    rng = np.random.default_rng(args.seed)
    prompt = rng.uniform(-1, 1, (args.prompt, model.d_model)).astype(np.float32)
    sent = []          # every input row the server has taken: the prefix a new stream replays
    generated = []
    replays = 0
    broken_in_a_row = 0  # streams that broke with no step taken between them
    session = None
    pending = prompt   # rows to send next: the prompt, then one fed-back output at a time
    while len(generated) < args.steps:
        if session is None:
            session = DecodeSession(stub, metadata)
            replay = np.concatenate(sent + [pending]) if sent else pending
            message = pb.DecodeRequest(model=model.name, kind=pb.ATTENTION_KIND_CAUSAL,
                                       input=to_tensor(pb, replay[None]))
        else:
            replay = pending
            message = pb.DecodeRequest(input=to_tensor(pb, pending[None]))
        try:
            response = session.step(grpc, message)
        except StreamBroken as e:
            replays += 1
            broken_in_a_row += 1
            if broken_in_a_row > args.max_replays:
                raise RuntimeError(f"gave up after {args.max_replays} replays in a row: {e}") from e
            # A draining replica refuses new streams until it has gone, and a new one takes a
            # moment to come up: wait 0.1 s, doubling to 1 s, before each new stream.
            delay = min(0.1 * 2 ** (broken_in_a_row - 1), 1.0)
            print(f"stream broke after {sum(len(s) for s in sent)} tokens ({e}); replaying the "
                  f"prefix on a new stream in {delay:.1f} s", flush=True)
            session.close()
            session = None
            time.sleep(delay)
            continue
        broken_in_a_row = 0
        output = from_tensor(response.output)[0]  # [n, d]: the rows this message appended
        if len(replay) != len(pending):
            print(f"replayed {len(replay) - len(pending)} tokens on a new stream; position "
                  f"{response.positions[0]}", flush=True)
        expected = sum(len(s) for s in sent) + len(pending)
        assert response.positions[0] == expected, (response.positions, expected)
        sent.append(pending)
        if pending is not prompt:
            generated.append(output[-1])
        pending = output[-1:].copy()  # generation: the last output is the next input
        if args.step_delay > 0:
            time.sleep(args.step_delay)
    session.close()
    return np.stack(generated), replays


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051")
    parser.add_argument("--lb-policy", default="", choices=["", "pick_first", "round_robin"])
    parser.add_argument("--model", default="", help="model name (default: the first causal one)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=32, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompt")
    parser.add_argument("--step-delay", type=float, default=0,
                        help="seconds between steps (the time a real decoder spends per token)")
    parser.add_argument("--max-replays", type=int, default=5,
                        help="new streams to try in a row, 0.1 s apart doubling to 1 s, before "
                        "giving up")
    parser.add_argument("--output", help="save the generated rows [steps, d_model] to this .npy")
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
    stub = pb_grpc.AttentionServiceStub(open_channel(grpc, args))
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    models = stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=metadata,
                             wait_for_ready=True).models
    model = next((m for m in models if (m.name == args.model or not args.model)
                  and m.serves_sessions), None)
    if model is None:
        sys.exit(f"no model {args.model!r} that serves sessions; the server has "
                 f"{[m.name for m in models]}")
    print(f"model {model.name}: d_model {model.d_model}; prompt {args.prompt}, "
          f"{args.steps} steps", flush=True)
    generated, replays = generate(grpc, pb, stub, args, model, metadata)
    print(f"generated {generated.shape[0]} tokens, {replays} replays; last row "
          f"norm {np.linalg.norm(generated[-1]):.4f}")
    if args.output:
        np.save(args.output, generated)
    print("ok")


if __name__ == "__main__":
    main()
