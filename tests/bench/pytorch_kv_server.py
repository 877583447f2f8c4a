#!/usr/bin/python3
"""The decode benchmark's peer: attnserve.v1 Decode sessions served the way a careful PyTorch
user would write them, so the session numbers of decode.py have something to be measured against.

grpcio's thread-pool server (one thread per stream) in front of a single compute thread that
batches the steps of every stream waiting: the Q/K/V projections of all their new tokens as one
torch.nn.functional.linear over the concatenated rows, each session's keys and values appended to
its own KV cache ([B, heads, capacity, head_dim] tensors, capacity doubled when full), attention
per session (scaled_dot_product_attention with a causal mask for prompts, no mask for 1-token
steps; the same math by matmul and softmax on torch releases without it, such as Debian 12's
1.13), then the output projection of all rows as one matmul, and each stream is answered.
torch runs on 2 threads.

It serves what attnserve-client bench --decode sends: ListModels (the load tester reads the
model's width first), then Decode streams of kind CAUSAL with padded [B, n, d_model] inputs,
lengths or none, raw or values float32. Anything else (CAUSAL_CROSS, a context, packed inputs,
truncate_to, a model version) is refused in the stream with an error_code and a message, as
attnserve refuses what it does not serve. grpc.health.v1 Check answers SERVING.

Weights: the safetensors layer file attnserve loads (--model NAME=PATH[:num_heads=N][:prefix=P]
there, --weights PATH [--name NAME] [--num-heads N] [--prefix P] here), any of its layouts.

  pytorch_kv_server.py --weights layer.safetensors --name wide --port 50071 [--port-file F]

--self-check starts attnserve (--build's server) with the same weights (written at random,
768-wide with 12 heads, when --weights is not given) and this server in-process, sends both the
same sessions (a 16-token prompt and 8 single-token steps; a prompt in two messages; ragged
lengths), and fails unless every output matches within 1e-4; then drives the peer once with
attnserve-client bench --decode. Run with Debian's python3 (/usr/bin/python3), which has
python3-torch and python3-grpcio. Debian's torch calls the system BLAS: without OpenBLAS
(libopenblas0-openmp, as deploy/install-deps.sh --torch installs) that is netlib's reference
BLAS, some 30x slower, and the server says so when it starts.
"""
import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

import openblas_core  # noqa: E402,F401  (sets OPENBLAS_CORETYPE before torch loads OpenBLAS)
# As attnserve does (server/main.cc): OpenMP threads sleep rather than spin between parallel
# regions. Spinning, they take the two cores from this process's own stream threads and from
# everything else on the machine: the peer ran 4-8x slower on a busy machine without it.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402  (after OPENBLAS_CORETYPE, which OpenBLAS reads when loaded)
import torch.nn.functional as F  # noqa: E402

THREADS = 2
# gRPC status codes, as DecodeResponse.error_code carries them.
INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 3, 5, 8, 12, 13
MAX_MESSAGE = 1 << 30
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


# ---------------------------------------------------------------------------------------------
# The layer: a safetensors file, any layout attnserve recognises (core/weights.cc).

def read_safetensors(path):
    """{name: float32 torch tensor}, __metadata__ of a safetensors file (F32, F16 or BF16)."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + size])
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + size
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = data[base + begin:base + end]
        dtype = info["dtype"]
        if dtype == "F32":
            array = np.frombuffer(raw, dtype="<f4")
        elif dtype == "F16":
            array = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif dtype == "BF16":
            array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: tensor '{name}' has dtype {dtype} (F32, F16 or BF16)")
        tensors[name] = torch.from_numpy(array.astype(np.float32).reshape(info["shape"]))
    return tensors, metadata


class Layer:
    """The fused [3 * inner, d_model] input projection, the output projection and the shapes."""

    def __init__(self, path, num_heads=None, prefix=""):
        tensors, metadata = read_safetensors(path)
        t = {name[len(prefix):]: v for name, v in tensors.items() if name.startswith(prefix)}
        if not t:
            raise ValueError(f"{path}: no tensor under the prefix '{prefix}'")
        w_o = b_o = None
        if "in_proj_weight" in t:
            self.layout = "torch_mha"
            w_qkv, b_qkv = t["in_proj_weight"], t.get("in_proj_bias")
            w_o, b_o = t["out_proj.weight"], t.get("out_proj.bias")
        elif "Wqkv.weight" in t:
            self.layout = "fused_qkv"
            w_qkv, b_qkv = t["Wqkv.weight"], t.get("Wqkv.bias")
            w_o, b_o = t["Wo.weight"], t.get("Wo.bias")
        elif "Wq.weight" in t:
            self.layout = "query_kv"
            w_qkv = torch.cat([t["Wq.weight"], t["Wkv.weight"]])
            b_qkv = torch.cat([t["Wq.bias"], t["Wkv.bias"]]) if "Wq.bias" in t else None
            w_o, b_o = t["Wo.weight"], t.get("Wo.bias")
        else:
            for layout, (q, k, v) in (("separate", ("W_q", "W_k", "W_v")),
                                      ("query_key_value", ("w_query", "w_key", "w_value"))):
                if q + ".weight" in t:
                    break
            else:
                raise ValueError(f"{path}: unknown layout: expected W_q/W_k/W_v, "
                                 f"w_query/w_key/w_value, Wqkv+Wo, Wq+Wkv+Wo or in_proj_weight+"
                                 f"out_proj; found {sorted(t)[:8]}")
            self.layout = layout
            w_qkv = torch.cat([t[q + ".weight"], t[k + ".weight"], t[v + ".weight"]])
            b_qkv = (torch.cat([t[q + ".bias"], t[k + ".bias"], t[v + ".bias"]])
                     if q + ".bias" in t else None)
        self.d_model = w_qkv.shape[1]
        self.inner = w_qkv.shape[0] // 3
        if num_heads is None:
            if "num_heads" not in metadata:
                raise ValueError(f"{path}: no num_heads in __metadata__ and none was given")
            num_heads = int(metadata["num_heads"])
        if num_heads <= 0 or self.inner % num_heads:
            raise ValueError(f"{path}: num_heads {num_heads} does not divide {self.inner}")
        self.heads, self.head_dim = num_heads, self.inner // num_heads
        self.out_width = w_o.shape[0] if w_o is not None else self.inner
        self.w_qkv, self.b_qkv = w_qkv.contiguous(), b_qkv
        self.w_o, self.b_o = (w_o.contiguous() if w_o is not None else None), b_o
        self.scale = 1.0 / float(self.head_dim) ** 0.5
        self.path = path


def blas_warning():
    """A warning when torch's matmuls run on a BLAS other than OpenBLAS (Debian's default is the
    reference BLAS, which would make every figure of this server meaningless), else None."""
    torch.mm(torch.ones(64, 64), torch.ones(64, 64))  # loads the BLAS
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        return None
    if ("openblas" in maps or "libmkl" in maps) and "/blas/libblas.so" not in maps:
        return None  # /usr/lib/<arch>/blas/ holds netlib's reference BLAS
    return ("WARNING: torch is not using OpenBLAS (reference BLAS?): its matmuls are ~30x "
            "slower; apt-get install libopenblas0-openmp")


def attention(q, k, v, mask, scale):
    """q [B, H, n, hd] over k, v [B, H, L, hd]; mask [B, 1, n, L] bool (True: attends) or None."""
    if HAS_SDPA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # torch 1.13: the same math. bmm on [B * H, ., hd] views (the cache's [B, H, L, hd] slice
    # folds without a copy): torch.matmul on the 4-d tensors is ~8x slower here.
    batch, heads, n, hd = q.shape
    length = k.shape[2]
    scores = torch.bmm(q.reshape(batch * heads, n, hd) * scale,
                       k.reshape(batch * heads, length, hd).transpose(1, 2))
    scores = scores.view(batch, heads, n, length)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).view(batch * heads, n, length)
    return torch.bmm(p, v.reshape(batch * heads, length, hd)).view(batch, heads, n, hd)


# ---------------------------------------------------------------------------------------------
# Sessions and the compute thread.

class Session:
    """One stream's B sequences: their cached lengths and keys/values [B, H, capacity, hd]."""

    def __init__(self, batch, layer):
        self.batch, self.layer = batch, layer
        self.lengths = [0] * batch
        self.capacity = 0
        self.k = self.v = None

    def reserve(self, tokens):
        """Room for `tokens` positions per sequence: the capacity doubles (at least 64)."""
        if tokens <= self.capacity:
            return
        capacity = max(64, 2 * self.capacity)
        while capacity < tokens:
            capacity *= 2
        shape = (self.batch, self.layer.heads, capacity, self.layer.head_dim)
        k, v = torch.zeros(shape), torch.zeros(shape)
        if self.k is not None:
            used = max(self.lengths)
            k[:, :, :used] = self.k[:, :, :used]
            v[:, :, :used] = self.v[:, :, :used]
        self.k, self.v, self.capacity = k, v, capacity


class Job:
    """One message's step: input [B, n, d], the tokens each sequence appends."""

    def __init__(self, session, x, lengths):
        self.session, self.x, self.lengths = session, x, lengths
        batch, n, _ = x.shape
        self.full = all(length == n for length in lengths)
        self.rows = None if self.full else (torch.arange(n)[None, :] <
                                            torch.tensor(lengths)[:, None])  # [B, n]
        self.tokens = sum(lengths)
        self.done = threading.Event()
        self.output = None  # [B, n, out_width], padded rows 0
        self.error = None

    def valid_rows(self, padded):
        """[B, n, w] -> [tokens, w]: the rows the sequences append."""
        return padded.reshape(-1, padded.shape[-1]) if self.full else padded[self.rows]

    def padded(self, rows, width):
        """[tokens, w] -> [B, n, w], padded rows 0."""
        batch, n, _ = self.x.shape
        if self.full:
            return rows.reshape(batch, n, width)
        out = rows.new_zeros(batch, n, width)
        out[self.rows] = rows
        return out


class Engine:
    """The one compute thread: takes every waiting step (up to max_tokens rows) and runs them
    as one batch."""

    def __init__(self, layer, max_tokens):
        self.layer, self.max_tokens = layer, max_tokens
        self.cv = threading.Condition()
        self.pending = deque()
        self.stats = {"runs": 0, "steps": 0, "tokens": 0, "seconds": 0.0}  # --stats prints them
        self.thread = threading.Thread(target=self._loop, name="compute", daemon=True)
        self.thread.start()

    def run(self, job):
        with self.cv:
            self.pending.append(job)
            self.cv.notify()
        job.done.wait()
        return job

    def _loop(self):
        torch.set_num_threads(THREADS)
        while True:
            with self.cv:
                while not self.pending:
                    self.cv.wait()
                jobs, tokens = [], 0
                while self.pending and (not jobs or tokens + self.pending[0].tokens <=
                                        self.max_tokens):
                    jobs.append(self.pending.popleft())
                    tokens += jobs[-1].tokens
            start = time.perf_counter()
            try:
                with torch.inference_mode():
                    self._compute(jobs)
            except Exception as e:  # noqa: BLE001  (every stream is answered, whatever broke)
                for job in jobs:
                    job.error = (INTERNAL, f"peer compute failed: {type(e).__name__}: {e}")
            for job in jobs:
                job.done.set()
            self.stats["runs"] += 1
            self.stats["steps"] += len(jobs)
            self.stats["tokens"] += tokens
            self.stats["seconds"] += time.perf_counter() - start

    def report(self, every):
        """Prints what the compute thread did in each `every` seconds that it did something."""
        last = dict(self.stats)
        while True:
            time.sleep(every)
            now = dict(self.stats)
            d = {k: now[k] - last[k] for k in now}
            last = now
            if d["runs"]:
                print(f"{d['runs']} compute runs: {d['steps'] / d['runs']:.1f} steps, "
                      f"{d['tokens'] / d['runs']:.1f} tokens, {1e3 * d['seconds'] / d['runs']:.2f}"
                      f" ms a run; busy {d['seconds'] / every:.0%}", file=sys.stderr, flush=True)

    def _compute(self, jobs):
        layer = self.layer
        h, hd, inner = layer.heads, layer.head_dim, layer.inner
        rows = [job.valid_rows(job.x) for job in jobs]
        x = rows[0] if len(rows) == 1 else torch.cat(rows)
        qkv = F.linear(x, layer.w_qkv, layer.b_qkv)  # [T, 3 * inner]: every stream's tokens
        attended, at = [], 0
        for job in jobs:
            part = qkv[at:at + job.tokens]
            at += job.tokens
            batch, n, _ = job.x.shape
            if job.tokens == 0:
                continue  # nothing appended: its output is all padding
            # [B, n, 3, H, hd] -> q, k, v [B, H, n, hd]
            q, k, v = job.padded(part, 3 * inner).view(batch, n, 3, h, hd).permute(2, 0, 3, 1, 4)
            s = job.session
            old = s.lengths
            new = [a + b for a, b in zip(old, job.lengths)]
            s.reserve(max(new))
            if job.full and min(old) == max(old):
                s.k[:, :, old[0]:new[0]] = k
                s.v[:, :, old[0]:new[0]] = v
            else:
                for b in range(batch):
                    if job.lengths[b]:
                        s.k[b, :, old[b]:new[b]] = k[b, :, :job.lengths[b]]
                        s.v[b, :, old[b]:new[b]] = v[b, :, :job.lengths[b]]
            longest = max(new)
            keys, values = s.k[:, :, :longest], s.v[:, :, :longest]
            if n == 1 and min(new) == longest:
                mask = None  # a 1-token step of equal sequences attends to every cached key
            else:
                # Query i of sequence b sits at position old[b] + i and sees keys 0..that.
                position = torch.tensor(old)[:, None] + torch.arange(n)[None, :]  # [B, n]
                mask = (torch.arange(longest)[None, None, :] <= position[:, :, None])[:, None]
            o = attention(q, keys, values, mask, layer.scale)  # [B, H, n, hd]
            attended.append(job.valid_rows(o.transpose(1, 2).reshape(batch, n, inner)))
            s.lengths = new
        o = attended[0] if len(attended) == 1 else torch.cat(attended or [qkv[:0, :inner]])
        y = F.linear(o, layer.w_o, layer.b_o) if layer.w_o is not None else o
        at = 0
        for job in jobs:
            job.output = job.padded(y[at:at + job.tokens], layer.out_width)
            at += job.tokens


# ---------------------------------------------------------------------------------------------
# The gRPC service.

def load_stubs(path):
    sys.path.insert(0, path)
    from attnserve.v1 import attention_pb2, attention_pb2_grpc
    return attention_pb2, attention_pb2_grpc


def make_service(pb, pb_grpc, layer, name, engine, max_session_tokens):
    def refuse(code, message):
        return pb.DecodeResponse(error_code=code, error_message=f"pytorch peer: {message}")

    def decode_input(tensor):
        shape = tuple(tensor.shape)
        if len(shape) == 2:
            return None, (UNIMPLEMENTED, "packed [T, d_model] input is not served: send padded "
                                         "[B, n, d_model]")
        if len(shape) != 3 or min(shape) < 0:
            return None, (INVALID_ARGUMENT, f"input shape {list(shape)} is not [B, n, d_model]")
        if shape[2] != layer.d_model:
            return None, (INVALID_ARGUMENT, f"input width {shape[2]} is not d_model "
                                            f"{layer.d_model}")
        count = shape[0] * shape[1] * shape[2]
        if tensor.raw and tensor.values:
            return None, (INVALID_ARGUMENT, "input has both values and raw")
        if tensor.raw:
            if len(tensor.raw) != 4 * count:
                return None, (INVALID_ARGUMENT, f"input raw has {len(tensor.raw)} bytes, shape "
                                                f"{list(shape)} needs {4 * count}")
            array = np.frombuffer(tensor.raw, dtype="<f4").astype(np.float32)
        else:
            if len(tensor.values) != count:
                return None, (INVALID_ARGUMENT, f"input has {len(tensor.values)} values, shape "
                                                f"{list(shape)} needs {count}")
            array = np.asarray(tensor.values, dtype=np.float32)
        return torch.from_numpy(array.reshape(shape)), None

    class Service(pb_grpc.AttentionServiceServicer):
        def ListModels(self, request, context):
            info = pb.ModelInfo(
                name=name, d_model=layer.d_model, d_context=layer.d_model, num_heads=layer.heads,
                head_dim=layer.head_dim, layout=layer.layout, has_bias=layer.b_qkv is not None,
                has_output_projection=layer.w_o is not None, precision="f32",
                kinds=[pb.ATTENTION_KIND_CAUSAL], source=layer.path, version=1,
                state=pb.MODEL_STATE_READY, serves_sessions=True)
            return pb.ListModelsResponse(models=[info])

        def Forward(self, request, context):
            context.abort(grpc.StatusCode.UNIMPLEMENTED,
                          "the PyTorch peer serves Decode sessions only")

        def Decode(self, request_iterator, context):
            session = None  # opened by the first message taken; freed with the stream
            for request in request_iterator:
                response, session = self._step(request, session, context)
                yield response

        def _step(self, request, session, context):
            """(the DecodeResponse, the session after it): a refusal leaves the session as is."""
            refusal, x = self._check(request, session, context)
            if refusal is not None:
                return refusal, session
            batch, n, _ = x.shape
            lengths = list(request.lengths) or [n] * batch
            if session is None:
                session = Session(batch, layer)
            job = engine.run(Job(session, x, lengths))
            if job.error:
                return refuse(*job.error), session
            y = job.output.numpy()
            response = pb.DecodeResponse(positions=session.lengths)
            response.output.shape.extend(y.shape)
            if request.input.raw or not request.input.values:
                response.output.raw = y.astype("<f4", copy=False).tobytes()
            else:
                response.output.values.extend(y.ravel().tolist())
            return response, session

        def _check(self, request, session, context):
            """(None, the input [B, n, d]) for a message that can run, else (its refusal, None)."""
            if request.model and request.model != name:
                if session is None:  # attnserve ends the stream for an unknown model
                    context.abort(grpc.StatusCode.NOT_FOUND,
                                  f"no model '{request.model}'; loaded: {name}")
                return refuse(INVALID_ARGUMENT, f"the session's model is '{name}', not "
                                                f"'{request.model}'"), None
            if request.version not in (0, 1):
                return refuse(UNIMPLEMENTED, f"model '{name}' has version 1 only, not "
                                             f"{request.version}"), None
            if request.kind not in (pb.ATTENTION_KIND_CAUSAL,) and (
                    session is None or request.kind != pb.ATTENTION_KIND_UNSPECIFIED):
                kind = pb.AttentionKind.Name(request.kind)
                if request.kind == pb.ATTENTION_KIND_CAUSAL_CROSS:
                    return refuse(UNIMPLEMENTED, "kind ATTENTION_KIND_CAUSAL_CROSS is not served "
                                                 "(ATTENTION_KIND_CAUSAL only)"), None
                return refuse(INVALID_ARGUMENT, f"a decode session's kind is "
                                                f"ATTENTION_KIND_CAUSAL, not {kind}"), None
            if request.HasField("context") or request.context_lengths:
                return refuse(UNIMPLEMENTED, "a context (CAUSAL_CROSS) is not served"), None
            if request.HasField("truncate_to"):
                return refuse(UNIMPLEMENTED, "truncate_to is not served"), None
            x, error = decode_input(request.input)
            if error:
                return refuse(*error), None
            batch, n, _ = x.shape
            if session is not None and batch != session.batch:
                return refuse(INVALID_ARGUMENT, f"the session has B = {session.batch} "
                                                f"sequences, input has {batch}"), None
            if batch < 1:
                return refuse(INVALID_ARGUMENT, "a decode session has B >= 1"), None
            lengths = list(request.lengths) or [n] * batch
            if len(lengths) != batch or any(not 0 <= length <= n for length in lengths):
                return refuse(INVALID_ARGUMENT, f"lengths {lengths[:8]} are not B = {batch} "
                                                f"values in [0, {n}]"), None
            held = session.lengths if session is not None else [0] * batch
            if any(a + b > max_session_tokens for a, b in zip(held, lengths)):
                return refuse(RESOURCE_EXHAUSTED, "a sequence would pass --max-session-tokens "
                                                  f"{max_session_tokens}"), None
            return None, x

    return Service()


def serve(layer, name, port, stubs, max_streams=1024, max_tokens=16384,
          max_session_tokens=32768, stats=0):
    """Starts the server on 127.0.0.1:port (0: any); returns (server, port)."""
    pb, pb_grpc = load_stubs(stubs)
    torch.set_num_threads(THREADS)
    engine = Engine(layer, max_tokens)
    # A stream holds a thread for its life: the load tester's sessions all wait at a barrier,
    # so there must be a thread for every one of them (threads start only when needed).
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + 4),
                         maximum_concurrent_rpcs=max_streams,
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                  ("grpc.max_send_message_length", MAX_MESSAGE),
                                  ("grpc.so_reuseport", 0)])
    pb_grpc.add_AttentionServiceServicer_to_server(
        make_service(pb, pb_grpc, layer, name, engine, max_session_tokens), server)

    def check(request_bytes, context):
        return b"\x08\x01"  # HealthCheckResponse{status: SERVING}
    health = grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)})
    server.add_generic_rpc_handlers((health,))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    if stats > 0:
        threading.Thread(target=engine.report, args=(stats,), daemon=True).start()
    return server, port


# ---------------------------------------------------------------------------------------------
# --self-check: the same sessions against attnserve and the peer.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_random_layer(path):
    """The 768-wide, 12-head layer decode.py benchmarks."""
    from decode import write_wide_layer
    write_wide_layer(path)


def start_attnserve(binary, workdir, spec):
    port = free_port()
    port_file = os.path.join(workdir, f"attnserve-port-{port}")
    log = open(os.path.join(workdir, f"attnserve-{port}.log"), "w")
    proc = subprocess.Popen([binary, "--listen", f"127.0.0.1:{port}", "--port-file", port_file,
                             "--metrics-listen", "off", "--http-listen", "off", "--log-level",
                             "warn", f"--model={spec}"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (os.path.exists(port_file) and open(port_file).read().endswith("\n")):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"attnserve did not start: {open(log.name).read()}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port}"


def tensor(pb, array, raw=True):
    t = pb.Tensor(shape=list(array.shape))
    if raw:
        t.raw = array.astype("<f4").tobytes()
    else:
        t.values.extend(array.ravel().tolist())
    return t


def from_tensor(t):
    data = (np.frombuffer(t.raw, dtype="<f4") if t.raw else np.asarray(t.values, np.float32))
    return data.reshape(tuple(t.shape))


def run_session(pb, pb_grpc, target, model, messages):
    """Sends `messages` ((input, lengths, raw) each) on one Decode stream: their responses.
    Every message names the model and kind (a later one may repeat them)."""
    channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length",
                                                      MAX_MESSAGE)])
    stub = pb_grpc.AttentionServiceStub(channel)
    requests = []
    for x, lengths, raw in messages:
        requests.append(pb.DecodeRequest(model=model, kind=pb.ATTENTION_KIND_CAUSAL,
                                          input=tensor(pb, x, raw), lengths=lengths))
    responses = list(stub.Decode(iter(requests), timeout=120))
    channel.close()
    return responses


def self_check(args):
    binary = os.path.join(args.build, "server", "attnserve")
    client = os.path.join(args.build, "client", "attnserve-client")
    pb, pb_grpc = load_stubs(args.stubs)
    with tempfile.TemporaryDirectory() as workdir:
        weights = args.weights
        if not weights:
            weights = os.path.join(workdir, "check.safetensors")
            write_random_layer(weights)
        spec = f"check={weights}" + (f":num_heads={args.num_heads}" if args.num_heads else "")
        spec += f":prefix={args.prefix}" if args.prefix else ""
        layer = Layer(weights, args.num_heads, args.prefix)
        d = layer.d_model
        proc, attnserve = start_attnserve(binary, workdir, spec)
        server, port = serve(layer, "check", 0, args.stubs)
        peer = f"127.0.0.1:{port}"
        rng = np.random.default_rng(5)

        def rand(*shape):
            return rng.standard_normal(shape).astype(np.float32)
        steps = [(rand(1, 1, d), [], True) for _ in range(8)]
        sessions = {
            "prompt 16 + 8 single-token steps, B=1": [(rand(1, 16, d), [], True)] + steps,
            "prompt 10 + 6 in two messages + 8 steps, B=2, values encoding":
                [(rand(2, 10, d), [], False), (rand(2, 6, d), [], False)] +
                [(rand(2, 1, d), [], False) for _ in range(8)],
            "prompt 60 + 8 steps, the cache doubling past 64 positions, B=2":
                [(rand(2, 60, d), [], True)] + [(rand(2, 1, d), [], True) for _ in range(8)],
            "ragged: lengths [16, 9, 0], then [2, 0, 1], then 8 steps, B=3":
                [(rand(3, 16, d), [16, 9, 0], True), (rand(3, 2, d), [2, 0, 1], True)] +
                [(rand(3, 1, d), [], True) for _ in range(8)],
        }
        failed = 0
        try:
            for label, messages in sessions.items():
                want = run_session(pb, pb_grpc, attnserve, "check", messages)
                got = run_session(pb, pb_grpc, peer, "check", messages)
                worst = 0.0
                for w, g in zip(want, got):
                    if w.error_code or g.error_code:
                        raise RuntimeError(f"{label}: refused: attnserve {w.error_message!r}, "
                                           f"peer {g.error_message!r}")
                    if list(w.positions) != list(g.positions):
                        raise RuntimeError(f"{label}: positions {list(w.positions)} (attnserve)"
                                           f" vs {list(g.positions)} (peer)")
                    worst = max(worst, float(np.abs(from_tensor(w.output) -
                                                    from_tensor(g.output)).max()))
                ok = len(want) == len(got) == len(messages) and worst <= 1e-4
                failed += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {label}: {len(got)} messages, max |attnserve - "
                      f"peer| = {worst:.2e}", flush=True)
            # A refusal in the stream: the session stays open and unchanged.
            r = run_session(pb, pb_grpc, peer, "check", [(rand(1, 2, d + 1), [], True),
                                                         (rand(1, 2, d), [], True)])
            ok = r[0].error_code == INVALID_ARGUMENT and list(r[1].positions) == [2]
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} a wrong width is refused in the stream "
                  f"({r[0].error_message}), the next message is taken", flush=True)
            if os.path.exists(client):
                argv = [client, "--target", peer, "bench", "--decode", "--model", "check",
                        "--sessions", "4", "--batch", "2", "--prompt", "32", "--steps", "8",
                        "--json"]
                out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
                ok = out.returncode == 0
                failed += not ok
                tps = json.loads(out.stdout)["decode"]["tokens_per_second"] if ok else 0
                print(f"{'ok  ' if ok else 'FAIL'} attnserve-client bench --decode drives the "
                      f"peer: {tps:.0f} tokens/s {out.stderr[-500:] if not ok else ''}",
                      flush=True)
        finally:
            server.stop(0)
            proc.terminate()
            proc.wait(timeout=60)
    print("self-check " + ("passed" if not failed else f"FAILED ({failed})"))
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", help="the layer's safetensors file (attnserve's --model PATH)")
    p.add_argument("--name", default="wide", help="the model's name in ListModels")
    p.add_argument("--num-heads", type=int, help="overrides the file's __metadata__ num_heads")
    p.add_argument("--prefix", default="", help="stripped from every tensor name")
    p.add_argument("--port", type=int, default=0, help="127.0.0.1 port (0: any free one)")
    p.add_argument("--port-file", help="written with the port and a newline once serving")
    p.add_argument("--max-streams", type=int, default=1024)
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="rows one compute run takes at most (a step is never split)")
    p.add_argument("--max-session-tokens", type=int, default=32768)
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--stubs", help="the generated attnserve.v1 stubs (default: BUILD/python)")
    p.add_argument("--stats", type=float, default=0, metavar="SECONDS",
                   help="print the compute runs' batching every SECONDS (0: never)")
    p.add_argument("--self-check", action="store_true",
                   help="compare with attnserve on the same weights, then exit")
    args = p.parse_args()
    args.stubs = args.stubs or os.path.join(args.build, "python")
    if args.self_check:
        sys.exit(self_check(args))
    if not args.weights:
        p.error("--weights PATH is needed (the layer file attnserve serves)")
    layer = Layer(args.weights, args.num_heads, args.prefix)
    server, port = serve(layer, args.name, args.port, args.stubs, args.max_streams,
                         args.max_batch_tokens, args.max_session_tokens, args.stats)
    print(f"pytorch peer serving '{args.name}' (d_model {layer.d_model}, {layer.heads} heads, "
          f"{layer.layout}) on 127.0.0.1:{port}, torch {torch.__version__}, "
          f"{THREADS} threads, sdpa {HAS_SDPA}", flush=True)
    if blas_warning():
        print(blas_warning(), file=sys.stderr, flush=True)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(f"{port}\n")
        os.replace(args.port_file + ".tmp", args.port_file)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
