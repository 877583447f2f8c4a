#pragma once

// The projections of a few rows (a generation step's token, a tiny call): y = x W + b read
// straight through W, without oneDNN. At one to four rows a matmul is a pass over the weights;
// oneDNN's per-execute setup (memory objects, argument map, kernel dispatch) then cost more than
// the pass itself (a 1-token step of the 256-wide demo layer: about half of its compute).

#include <cstdint>

namespace attnserve::core {

// The most rows SmallMatmul takes.
inline constexpr int64_t kSmallMatmulRows = 4;

// y[rows, n] = x[rows, k] W + bias (bias may be null), all f32, row-major: x's rows k apart,
// y's n apart, W [k, n] with rows `ld` apart (W^T of nn.Linear's weight). rows <= 4. Runs on the
// calling thread, on the widest vectors this CPU has.
void SmallMatmul(int64_t rows, int64_t k, int64_t n, const float* x, const float* w, int64_t ld,
                 const float* bias, float* y);

}  // namespace attnserve::core
