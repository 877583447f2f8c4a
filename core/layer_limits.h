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

// Below this many floats touched, a copy loop runs on one thread: starting an OpenMP team
// costs more than it saves, and on a loaded machine a descheduled team member stalls it.
inline constexpr int64_t kParallelFloats = int64_t{1} << 16;

// The rows the matmuls run on for `rows` valid tokens (padding rows of the buckets are zeros).
// The steps keep the padding under 2% of the rows (12% for tiny calls, where it is cheap) and
// the buckets under ~200 per weight matrix.
inline int64_t MatmulRows(int64_t rows) {
  if (rows >= kRuntimeRowsFrom) return rows;
  const int64_t step = rows <= 128 ? 16 : rows <= 8192 ? 64 : 512;
  return (rows + step - 1) / step * step;
}

}  // namespace attnserve::core
