#!/usr/bin/python3
"""Moves a model between two of its versions while calls keep coming, through the Open Inference
Protocol's repository extension (Triton's RepositoryModelLoad with a `config` parameter), and
shows that no call fails and every call is answered by one version (the reply's model_version).
Loading the first version again at the end is a rollback.

Needs an attnserve serving a repository in explicit mode with both versions in it
(docs/model-repository.md), Debian's python3-grpcio and python3-numpy, and the stubs the CMake
build generates into build/python (--stubs, else $ATTNSERVE_PY_STUBS, else ../../build/python):

    build/server/attnserve --model-repository /models --model-control-mode explicit \\
        --load-model enc &
    /usr/bin/python3 client/python/version_swap.py --target localhost:50051 --model enc \\
        --versions 1,2 --swaps 4

Load calls need a token of the server's --admin-token-file (ATTNSERVE_ADMIN_TOKEN, or --token),
sent as 'authorization: Bearer TOKEN'; without that file the server takes them from loopback.
"""
import argparse
import collections
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from infer_example import infer_request, load_stubs  # noqa: E402  (the same stubs and request)


def parse_args():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="localhost:50051")
    parser.add_argument("--model", required=True)
    parser.add_argument("--versions", default="1,2", help="FROM,TO: the two versions to swap")
    parser.add_argument("--swaps", type=int, default=4, help="moves between the two versions")
    parser.add_argument("--callers", type=int, default=2, help="threads calling meanwhile")
    parser.add_argument("--token", default=os.environ.get("ATTNSERVE_ADMIN_TOKEN", ""))
    parser.add_argument("--stubs", default=os.environ.get(
        "ATTNSERVE_PY_STUBS", os.path.join(here, "..", "..", "build", "python")))
    return parser.parse_args()


class Swapper:
    """The repository calls: load exactly one version of the model (a specific version policy)."""

    def __init__(self, pb, stub, model, token):
        self.pb, self.stub, self.model = pb, stub, model
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    def serve_only(self, version):
        config = json.dumps({"version_policy": {"specific": {"versions": [version]}}})
        request = self.pb.RepositoryModelLoadRequest(
            model_name=self.model,
            parameters={"config": self.pb.ModelRepositoryParameter(string_param=config)})
        self.stub.RepositoryModelLoad(request, metadata=self.metadata, timeout=120)

    def ready_versions(self):
        index = self.stub.RepositoryIndex(self.pb.RepositoryIndexRequest(ready=True), timeout=10)
        return sorted(int(m.version) for m in index.models if m.name == self.model)


def call_until(stop, pb, stub, model, width, answered, failures, lock):
    """ModelInfer calls of the newest ready version until `stop`; counts who answered."""
    x = np.random.default_rng(1).standard_normal((1, 16, width)).astype(np.float32)
    request = infer_request(pb, model, "bidirectional", {"input": x})
    while not stop.is_set():
        try:
            reply = stub.ModelInfer(request, timeout=30)
            with lock:
                answered[reply.model_version] += 1
        except Exception as e:  # noqa: BLE001  (every failure is reported, none expected)
            with lock:
                failures.append(str(e))


def main():
    args = parse_args()
    import grpc
    pb, pb_grpc = load_stubs(args.stubs)
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(args.target))
    first, second = (int(v) for v in args.versions.split(","))
    swapper = Swapper(pb, stub, args.model, args.token)
    swapper.serve_only(first)
    width = stub.ModelMetadata(pb.ModelMetadataRequest(name=args.model), timeout=10).inputs[0].shape[-1]
    stop, lock = threading.Event(), threading.Lock()
    answered, failures = collections.Counter(), []
    callers = [threading.Thread(target=call_until, args=(stop, pb, stub, args.model, width,
                                                         answered, failures, lock))
               for _ in range(args.callers)]
    for caller in callers:
        caller.start()
    for swap in range(args.swaps):
        version = second if swap % 2 == 0 else first
        swapper.serve_only(version)
        print(f"swap {swap + 1}: ready versions {swapper.ready_versions()}", flush=True)
        time.sleep(0.2)
    swapper.serve_only(first)  # the rollback: the first version again
    print(f"rolled back: ready versions {swapper.ready_versions()}")
    stop.set()
    for caller in callers:
        caller.join()
    by_version = ", ".join(f"version {v}: {n}" for v, n in sorted(answered.items()))
    print(f"calls: {sum(answered.values())} answered ({by_version}), {len(failures)} failed")
    if failures:
        sys.exit(f"first failure: {failures[0]}")


if __name__ == "__main__":
    main()
