#include "core/small_matmul.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <vector>

// One body, compiled for AVX-512, for AVX2 + FMA and portable (per-function target attributes,
// as kv_attention.cc); the widest the CPU has is chosen once at run time.

namespace attnserve::core {
namespace {

// Each flavour works on vectors its registers hold: 16 floats for AVX-512, 8 for AVX2, 4 for the
// portable one (SSE2, NEON). A wider vector type than the target has is kept in memory by GCC, so
// that every operation on it loads and stores: a 768-wide layer's 1-token decode step on AVX2
// (Zen 3) took 2.36 ms instead of 1.18.
typedef float Floats16 __attribute__((vector_size(64)));
typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats4 __attribute__((vector_size(16)));

constexpr int64_t kPanel = SmallMatmulWeights::kPanel;

// Rows 0 .. R-1 of a strip of one panel's columns, `Vectors` vectors V wide: the accumulators stay
// in registers over all of k, the strip is read once, front to back (its rows kPanel floats
// apart). Columns [first, first + cols) of W are y's; the strip's first column is W's column `c`.
// A strip wholly inside them is stored as vectors; one across their edge (a view that does not
// start or end on a strip) column by column.
template <typename V, int R, int Vectors>
[[gnu::always_inline]] inline void Strip(int64_t k, const float* x, const float* strip, int64_t c,
                                         int64_t first, int64_t cols, const float* bias, float* y) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  constexpr int64_t kWidth = kLanes * Vectors;
  const bool whole = c >= first && c + kWidth <= first + cols;
  V acc[R][Vectors];
  for (int j = 0; j < Vectors; ++j) {
    V b = {};
    if (whole && bias != nullptr) __builtin_memcpy(&b, bias + (c - first) + kLanes * j, sizeof(b));
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* row = strip + i * kPanel;
    V w[Vectors];
    for (int j = 0; j < Vectors; ++j) __builtin_memcpy(&w[j], row + kLanes * j, sizeof(V));
    for (int r = 0; r < R; ++r) {
      const float xi = x[r * k + i];
      for (int j = 0; j < Vectors; ++j) acc[r][j] += xi * w[j];
    }
  }
  if (whole) {
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < Vectors; ++j) {
        __builtin_memcpy(y + r * cols + (c - first) + kLanes * j, &acc[r][j], sizeof(V));
      }
    }
    return;
  }
  const int64_t lo = std::max(c, first), hi = std::min(c + kWidth, first + cols);
  for (int r = 0; r < R; ++r) {
    alignas(64) float sums[kWidth];
    __builtin_memcpy(sums, acc[r], sizeof(sums));
    for (int64_t col = lo; col < hi; ++col) {
      y[r * cols + (col - first)] = sums[col - c] + (bias != nullptr ? bias[col - first] : 0.0f);
    }
  }
}

// Each panel a strip at a time, as wide as `Accumulators` vectors V for R rows allow (the
// registers the flavour has, less those the strip's weights and x take), at most the panel.
template <typename V, int Accumulators, int R>
[[gnu::always_inline]] inline void Body(const SmallMatmulWeights& w, int64_t first, int64_t cols,
                                        const float* x, const float* bias, float* y) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  constexpr int kVectors = std::max<int>(1, std::min<int>(kPanel / kLanes, Accumulators / R));
  constexpr int64_t kWidth = kLanes * kVectors;
  static_assert(kPanel % kWidth == 0, "a panel is whole strips");
  for (int64_t c = first / kWidth * kWidth; c < first + cols; c += kWidth) {
    Strip<V, R, kVectors>(w.k(), x, w.panel(c / kPanel) + c % kPanel, c, first, cols, bias, y);
  }
}

template <typename V, int Accumulators>
[[gnu::always_inline]] inline void Dispatch(int64_t rows, const SmallMatmulWeights& w,
                                            int64_t first, int64_t cols, const float* x,
                                            const float* bias, float* y) {
  switch (rows) {
    case 1:
      return Body<V, Accumulators, 1>(w, first, cols, x, bias, y);
    case 2:
      return Body<V, Accumulators, 2>(w, first, cols, x, bias, y);
    case 3:
      return Body<V, Accumulators, 3>(w, first, cols, x, bias, y);
    default:
      return Body<V, Accumulators, 4>(w, first, cols, x, bias, y);
  }
}

using MatmulFn = void (*)(int64_t rows, const SmallMatmulWeights& w, int64_t first, int64_t cols,
                          const float* x, const float* bias, float* y);

// 16 registers (SSE2; NEON's 32 hold as many as it uses).
void Portable(int64_t rows, const SmallMatmulWeights& w, int64_t first, int64_t cols,
              const float* x, const float* bias, float* y) {
  Dispatch<Floats4, 8>(rows, w, first, cols, x, bias, y);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// 16 ymm registers.
__attribute__((target("avx2,fma"))) void Avx2(int64_t rows, const SmallMatmulWeights& w,
                                              int64_t first, int64_t cols, const float* x,
                                              const float* bias, float* y) {
  Dispatch<Floats8, 8>(rows, w, first, cols, x, bias, y);
}

// 32 zmm registers: four rows of a whole panel.
__attribute__((target("avx512f,avx2,fma"))) void Avx512(int64_t rows, const SmallMatmulWeights& w,
                                                        int64_t first, int64_t cols, const float* x,
                                                        const float* bias, float* y) {
  Dispatch<Floats16, 16>(rows, w, first, cols, x, bias, y);
}
#endif

// One flavour: its name and its kernel.
struct Flavour {
  const char* name;
  MatmulFn fn;
};

// The flavours this CPU runs, widest first.
std::vector<Flavour> Flavours() {
  std::vector<Flavour> flavours;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx512f")) flavours.push_back({"avx512", &Avx512});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    flavours.push_back({"avx2", &Avx2});
  }
#endif
  flavours.push_back({"portable", &Portable});
  return flavours;
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
  static const MatmulFn selected = Flavours().front().fn;
  selected(std::clamp<int64_t>(rows, 1, kSmallMatmulRows), w, first, cols, x, bias, y);
}

std::vector<std::string> SmallMatmulFlavours() {
  std::vector<std::string> names;
  for (const Flavour& flavour : Flavours()) names.emplace_back(flavour.name);
  return names;
}

void SmallMatmulWith(std::string_view flavour, int64_t rows, const SmallMatmulWeights& w,
                     int64_t first, int64_t cols, const float* x, const float* bias, float* y) {
  for (const Flavour& f : Flavours()) {
    if (flavour == f.name)
      f.fn(std::clamp<int64_t>(rows, 1, kSmallMatmulRows), w, first, cols, x, bias, y);
  }
}

}  // namespace attnserve::core
