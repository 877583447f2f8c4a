#!/usr/bin/python3
"""The serving benchmark's baseline: attnserve.v1 Forward served the way a Python team would
write it, grpcio's thread-pool server around PyTorch's nn.MultiheadAttention (one compute thread
per worker, as the serving benchmark measures), with the demo layer's shapes (d_model 256,
4 heads) and masks from the lengths. It answers raw and values encodings, padded inputs only
(what the benchmark sends), and serves grpc.health.v1 for the readiness wait.

  baseline_server.py --port 50061 [--workers 2] [--stubs build/python]
"""
import argparse
import os
import sys
from concurrent import futures

import grpc
import numpy as np
import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--stubs", default=os.path.join(os.path.dirname(__file__), "../../build/python"))
    args = p.parse_args()
    sys.path.insert(0, args.stubs)
    from attnserve.v1 import attention_pb2 as pb
    from attnserve.v1 import attention_pb2_grpc as pb_grpc

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(256, 4, batch_first=True).eval()

    class Service(pb_grpc.AttentionServiceServicer):
        def Forward(self, request, context):
            shape = tuple(request.input.shape)
            if len(shape) != 3:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "baseline: padded input only")
            raw = bool(request.input.raw)
            x = (np.frombuffer(request.input.raw, dtype="<f4") if raw
                 else np.asarray(request.input.values, dtype=np.float32)).reshape(shape)
            b, s, _ = shape
            lengths = list(request.lengths) or [s] * b
            key_padding = torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]
            causal = request.kind in (pb.ATTENTION_KIND_CAUSAL, pb.ATTENTION_KIND_CAUSAL_CROSS)
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1) if causal else None
            with torch.inference_mode():
                xt = torch.from_numpy(x.copy())
                out, _ = layer(xt, xt, xt, key_padding_mask=key_padding, attn_mask=mask,
                               need_weights=False)
                out = out * (~key_padding)[:, :, None]
            y = out.numpy().astype("<f4")
            response = pb.ForwardResponse()
            response.output.shape.extend(y.shape)
            if raw:
                response.output.raw = y.tobytes()
            else:
                response.output.values.extend(y.ravel().tolist())
            return response

    def check(request_bytes, context):
        return b"\x08\x01"  # HealthCheckResponse{status: SERVING}

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers),
                         options=[("grpc.max_receive_message_length", 256 << 20),
                                  ("grpc.max_send_message_length", 256 << 20)])
    pb_grpc.add_AttentionServiceServicer_to_server(Service(), server)
    health = grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)})
    server.add_generic_rpc_handlers((health,))
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"baseline serving on 127.0.0.1:{args.port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
