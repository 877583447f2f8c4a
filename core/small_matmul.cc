#include "core/small_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

// One body, compiled for AVX-512, for AVX2 + FMA and portable (per-function target attributes,
// as kv_attention.cc), on 16-float vectors; the widest the CPU has is chosen once at run time.

namespace attnserve::core {
namespace {

typedef float Floats16 __attribute__((vector_size(64)));

constexpr int64_t kPanel = SmallMatmulWeights::kPanel;
static_assert(kPanel == 64, "a panel row is four 16-float vectors");

// Rows 0 .. R-1 of one panel's columns: the accumulators stay in registers over all of k, the
// panel is read once, front to back. Columns [first, first + cols) of W are y's; the panel's
// first column is W's column `c`. A panel wholly inside them is stored as vectors; one across
// their edge (a view that does not start or end on a panel) column by column.
template <int R>
[[gnu::always_inline]] inline void Panel(int64_t k, const float* x, const float* panel, int64_t c,
                                         int64_t first, int64_t cols, const float* bias, float* y) {
  const bool whole = c >= first && c + kPanel <= first + cols;
  Floats16 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    Floats16 b = {};
    if (whole && bias != nullptr) __builtin_memcpy(&b, bias + (c - first) + 16 * j, sizeof(b));
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* row = panel + i * kPanel;
    Floats16 w0, w1, w2, w3;
    __builtin_memcpy(&w0, row, sizeof(w0));
    __builtin_memcpy(&w1, row + 16, sizeof(w1));
    __builtin_memcpy(&w2, row + 32, sizeof(w2));
    __builtin_memcpy(&w3, row + 48, sizeof(w3));
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * k + i];
      acc[r][0] += xi * w0;
      acc[r][1] += xi * w1;
      acc[r][2] += xi * w2;
      acc[r][3] += xi * w3;
    }
  }
  if (whole) {
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        __builtin_memcpy(y + r * cols + (c - first) + 16 * j, &acc[r][j], sizeof(acc[r][j]));
      }
    }
    return;
  }
  const int64_t lo = std::max(c, first), hi = std::min(c + kPanel, first + cols);
  for (int r = 0; r < R; ++r) {
    alignas(64) float sums[kPanel];
    __builtin_memcpy(sums, acc[r], sizeof(sums));
    for (int64_t col = lo; col < hi; ++col) {
      y[r * cols + (col - first)] = sums[col - c] + (bias != nullptr ? bias[col - first] : 0.0f);
    }
  }
}

template <int R>
[[gnu::always_inline]] inline void Body(const SmallMatmulWeights& w, int64_t first, int64_t cols,
                                        const float* x, const float* bias, float* y) {
  for (int64_t p = first / kPanel; p * kPanel < first + cols; ++p) {
    Panel<R>(w.k(), x, w.panel(p), p * kPanel, first, cols, bias, y);
  }
}

[[gnu::always_inline]] inline void Dispatch(int64_t rows, const SmallMatmulWeights& w,
                                            int64_t first, int64_t cols, const float* x,
                                            const float* bias, float* y) {
  switch (rows) {
    case 1:
      return Body<1>(w, first, cols, x, bias, y);
    case 2:
      return Body<2>(w, first, cols, x, bias, y);
    case 3:
      return Body<3>(w, first, cols, x, bias, y);
    default:
      return Body<4>(w, first, cols, x, bias, y);
  }
}

using MatmulFn = void (*)(int64_t rows, const SmallMatmulWeights& w, int64_t first, int64_t cols,
                          const float* x, const float* bias, float* y);

void Portable(int64_t rows, const SmallMatmulWeights& w, int64_t first, int64_t cols,
              const float* x, const float* bias, float* y) {
  Dispatch(rows, w, first, cols, x, bias, y);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void Avx2(int64_t rows, const SmallMatmulWeights& w,
                                              int64_t first, int64_t cols, const float* x,
                                              const float* bias, float* y) {
  Dispatch(rows, w, first, cols, x, bias, y);
}

__attribute__((target("avx512f,avx2,fma"))) void Avx512(int64_t rows, const SmallMatmulWeights& w,
                                                        int64_t first, int64_t cols, const float* x,
                                                        const float* bias, float* y) {
  Dispatch(rows, w, first, cols, x, bias, y);
}
#endif

MatmulFn Selected() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx512f")) return &Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &Avx2;
#endif
  return &Portable;
}

}  // namespace

void SmallMatmulWeights::AlignedFree::operator()(float* p) const { std::free(p); }

SmallMatmulWeights::SmallMatmulWeights(int64_t k, int64_t n, const float* w, int64_t ld)
    : k_(k), n_(n) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(panels * k * kPanel, 16)) * 4;
  data_.reset(static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  if (data_ == nullptr) throw std::bad_alloc();
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t c = p * kPanel, width = std::min(kPanel, n - c);
    float* out = data_.get() + p * k * kPanel;
    for (int64_t i = 0; i < k; ++i) {
      std::memcpy(out + i * kPanel, w + i * ld + c, width * sizeof(float));
      std::fill(out + i * kPanel + width, out + (i + 1) * kPanel, 0.0f);
    }
  }
}

void SmallMatmul(int64_t rows, const SmallMatmulWeights& w, int64_t first, int64_t cols,
                 const float* x, const float* bias, float* y) {
  static const MatmulFn selected = Selected();
  selected(std::clamp<int64_t>(rows, 1, kSmallMatmulRows), w, first, cols, x, bias, y);
}

}  // namespace attnserve::core
