#pragma once

// The projections of a few rows (a generation step's token, a tiny call): y = x W + b, one pass
// over W, without oneDNN. At one to four rows a matmul is a pass over the weights; oneDNN's
// per-execute setup (memory objects, argument map, kernel dispatch) then cost more than the pass
// itself (a 1-token step of the 256-wide demo layer: about half of its compute). The pass reads
// W repacked in panels of columns, each one contiguous stream: read in place from W^T, each
// panel's rows lay a row of W^T apart, and a pass over weights not in the cache (a step after
// the attention's stream of cached keys) ran at 8-10 GB/s instead of 24.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace attnserve::core {

// The most rows SmallMatmul takes.
inline constexpr int64_t kSmallMatmulRows = 4;

// W [k, n] as SmallMatmul reads it: panels of kPanel columns, each [k][kPanel] row-major and
// contiguous, the last one zero-padded; 64-byte aligned. Immutable once made.
class SmallMatmulWeights {
 public:
  static constexpr int64_t kPanel = 64;

  // From W^T of nn.Linear's weight: row-major [k, n], rows `ld` apart (a column block of a wider
  // matrix when ld > n).
  SmallMatmulWeights(int64_t k, int64_t n, const float* w, int64_t ld);

  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  const float* panel(int64_t p) const { return data_.get() + p * k_ * kPanel; }

 private:
  struct AlignedFree {
    void operator()(float* p) const;
  };
  int64_t k_, n_;
  std::unique_ptr<float[], AlignedFree> data_;
};

// y[rows, cols] = x[rows, k] W[:, first, first + cols) + bias, all f32, row-major (y's rows
// `cols` apart); bias [cols] or null. rows <= kSmallMatmulRows. Runs on the calling thread, on
// the widest vectors this CPU has.
void SmallMatmul(int64_t rows, const SmallMatmulWeights& w, int64_t first, int64_t cols,
                 const float* x, const float* bias, float* y);

// The flavours this CPU runs, widest first ("avx512", "avx2", "portable"), and SmallMatmul on one
// of them (nothing for a name not listed): for tests and comparisons.
std::vector<std::string> SmallMatmulFlavours();
void SmallMatmulWith(std::string_view flavour, int64_t rows, const SmallMatmulWeights& w,
                     int64_t first, int64_t cols, const float* x, const float* bias, float* y);

}  // namespace attnserve::core
