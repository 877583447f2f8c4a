#!/usr/bin/python3
"""The standard shapes of shapes.cc the way a PyTorch user runs them: nn.MultiheadAttention on
padded batches with key-padding (and causal) masks, in inference mode. Prints the JSON lines of
attnserve_bench (same shapes, same ragged lengths, same useful-FLOP count, peak = a 4096^3 f32
matmul in the same run) so compare.sh can set them side by side.

Run with Debian's python3 (/usr/bin/python3), which has torch.
"""
import argparse
import json
import os
import statistics
import time

import openblas_core  # noqa: E402,F401  (sets OPENBLAS_CORETYPE before torch loads OpenBLAS)

import torch  # noqa: E402  (after OPENBLAS_CORETYPE, which OpenBLAS reads when loaded)
import torch.nn as nn

MASK64 = (1 << 64) - 1


def splitmix64(state):
    """One step of the generator bench/shapes.cc uses: returns (new_state, value)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def ragged_lengths():
    """The 16 lengths of "ragged": 32 + splitmix64(seed 7) % 481, exactly as shapes.cc."""
    state, lengths = 7, []
    for _ in range(16):
        state, v = splitmix64(state)
        lengths.append(32 + v % 481)
    return lengths


def uniform(name, kind, batch, length, d_model=768, heads=12):
    return dict(name=name, kind=kind, d_model=d_model, heads=heads, lengths=[length] * batch,
                padded=length, kv_lengths=[length] * batch, kv_padded=length)


def all_shapes():
    shapes = [
        uniform("bert", "bidirectional", 8, 512),
        uniform("causal", "causal", 4, 1024),
        uniform("ragged", "bidirectional", 16, 512),
        uniform("cross", "cross", 8, 128),
        uniform("small", "bidirectional", 1, 16, 256, 4),
        uniform("long", "causal", 1, 4096, 512, 8),
        uniform("long32k", "causal", 1, 32768, 512, 8),
    ]
    shapes[2]["lengths"] = shapes[2]["kv_lengths"] = ragged_lengths()
    shapes[3]["kv_lengths"], shapes[3]["kv_padded"] = [512] * 8, 512
    return {s["name"]: s for s in shapes}


def useful_flops(s):
    """The useful count: padding and the masked half of causal attention are not useful."""
    d = inner = ctx = s["d_model"]
    share = 0.5 if s["kind"].startswith("causal") else 1.0
    return sum(2 * l * d * inner + 4 * k * ctx * inner + share * 4 * l * k * inner + 2 * l * inner * d
               for l, k in zip(s["lengths"], s["kv_lengths"]))


def alternating_median_ms(fns, reps):
    """Medians of `reps` rounds calling every fn once in turn, after an untimed warm-up round:
    a load change on the shared machine hits all of them alike (as attnserve_bench does)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


PEAK_N = 4096


def peak_call():
    """A 4096^3 f32 matmul: the peak each shape's efficiency divides by."""
    a, b = torch.rand(PEAK_N, PEAK_N), torch.rand(PEAK_N, PEAK_N)
    return lambda: torch.matmul(a, b)


def padding_mask(lengths, padded):
    """True where a key is padding (nn.MultiheadAttention's key_padding_mask convention)."""
    return torch.arange(padded).view(1, -1) >= torch.tensor(lengths).view(-1, 1)


def run_shape(s, reps, peak_fn, dtype):
    """Times one shape, its calls alternating with calls of `peak_fn`."""
    mha = nn.MultiheadAttention(s["d_model"], s["heads"], batch_first=True).eval().to(dtype)
    batch = len(s["lengths"])
    x = torch.rand(batch, s["padded"], s["d_model"], dtype=dtype) * 2 - 1
    cross = s["kind"] in ("cross", "causal_cross")
    ctx = torch.rand(batch, s["kv_padded"], s["d_model"], dtype=dtype) * 2 - 1 if cross else x
    key_mask = padding_mask(s["kv_lengths"], s["kv_padded"])
    attn_mask = None
    if s["kind"].startswith("causal"):
        attn_mask = torch.triu(torch.ones(s["padded"], s["kv_padded"], dtype=torch.bool), 1)

    def call():
        with torch.inference_mode():
            out, _ = mha(x, ctx, ctx, key_padding_mask=key_mask, attn_mask=attn_mask,
                         need_weights=False)
            # padded query rows zeroed, as attnserve answers them
            return out.masked_fill(padding_mask(s["lengths"], s["padded"]).unsqueeze(-1), 0.0)

    ms, peak_ms = alternating_median_ms([call, peak_fn], reps)
    peak = 2 * PEAK_N ** 3 / peak_ms / 1e6
    useful = useful_flops(s) / ms / 1e6
    return dict(shape=s["name"], tokens=sum(s["lengths"]), ms=round(ms, 3),
                useful_gflops=round(useful, 2), peak_gflops=round(peak, 2),
                efficiency=round(useful / peak, 4), scratch_mib=None)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="bert,causal,ragged,cross,small,long")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shapes = all_shapes()
    unknown = [n for n in args.shapes.split(",") if n and n not in shapes]
    if unknown:
        p.error(f"unknown shapes {unknown} (known: {','.join(shapes)})")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak_fn = peak_call()
    for name in filter(None, args.shapes.split(",")):
        print(json.dumps(run_shape(shapes[name], args.reps, peak_fn, dtype)), flush=True)


if __name__ == "__main__":
    main()
