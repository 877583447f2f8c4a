#pragma once

// The sizes Layer's validation (layer_validate.cc) and its forward pass (layer.cc) agree on:
// the largest buffer a call may imply, the row buckets the matmuls run on, and when a loop
// over floats is worth an OpenMP team.

#include <cstdint>

namespace attnserve::core {

// The largest buffer (in floats) a call may imply. Far above any real request (32k tokens of
// width 3*4096 is 4e8), low enough that a forged size is refused instead of allocated.
inline constexpr int64_t kMaxElements = int64_t{1} << 32;

// Row counts are rounded up to buckets, each a fixed-M primitive of its own: oneDNN 2.6 serves a
// runtime M (DNNL_RUNTIME_DIM_VAL) only with gemm:jit, measured 10-35% slower than the fixed-M
// brgemm at 1024-4888 rows and 2x slower below 128 (calls alternating, same process). Past
// kRuntimeRowsFrom one runtime-M primitive takes over, bounding the number of primitives.
inline constexpr int64_t kRuntimeRowsFrom = 65537;

// Calls and decode runs with less useful work than this (~0.3 ms on one core) run on the calling
// thread alone: every OpenMP region of the call (ours, oneDNN's, the kernel's) would wait for the
// whole team, and on a shared machine that wait was measured at tens of ms for the 16-token shape.
inline constexpr double kSerialFlops = 4e7;

// Below this many floats touched, a copy loop runs on one thread: starting an OpenMP team
// costs more than it saves, and on a loaded machine a descheduled team member stalls it.
inline constexpr int64_t kParallelFloats = int64_t{1} << 16;

// The rows the matmuls run on for `rows` valid tokens (padding rows of the buckets are zeros).
// Buckets of 16 rows up to 128, 64 up to 8192, 512 past it keep the padding small against the
// call and the buckets under ~200 per weight matrix. Up to 16 rows they are powers of two: a
// generation step's one token would otherwise run a 16-row matmul, 16 times its work.
inline int64_t MatmulRows(int64_t rows) {
  if (rows >= kRuntimeRowsFrom) return rows;
  if (rows <= 16) {
    int64_t bucket = rows > 0 ? 1 : 0;
    while (bucket < rows) bucket *= 2;
    return bucket;
  }
  const int64_t step = rows <= 128 ? 16 : rows <= 8192 ? 64 : 512;
  return (rows + step - 1) / step * step;
}

}  // namespace attnserve::core
