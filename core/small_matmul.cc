#include "core/small_matmul.h"

#include <algorithm>

// One body, compiled for AVX-512, for AVX2 + FMA and portable (per-function target attributes,
// as kv_attention.cc), on 16-float vectors; the widest the CPU has is chosen once at run time.

namespace attnserve::core {
namespace {

typedef float Floats16 __attribute__((vector_size(64)));

// Columns a tile of y keeps in registers: four 16-float vectors a row.
constexpr int64_t kTile = 64;

// Rows 0 .. R-1 of y, columns [c, c + kTile): the accumulators stay in registers over all of k,
// W's rows are read once.
template <int R>
[[gnu::always_inline]] inline void Tile(int64_t k, const float* x, const float* w, int64_t ld,
                                        const float* bias, float* y, int64_t n, int64_t c) {
  Floats16 acc[R][4];
  for (int j = 0; j < 4; ++j) {
    Floats16 b = {};
    if (bias != nullptr) __builtin_memcpy(&b, bias + c + 16 * j, sizeof(b));
    for (int r = 0; r < R; ++r) acc[r][j] = b;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* row = w + i * ld + c;
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
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) __builtin_memcpy(y + r * n + c + 16 * j, &acc[r][j], 64);
  }
}

template <int R>
[[gnu::always_inline]] inline void Body(int64_t k, int64_t n, const float* x, const float* w,
                                        int64_t ld, const float* bias, float* y) {
  int64_t c = 0;
  for (; c + kTile <= n; c += kTile) Tile<R>(k, x, w, ld, bias, y, n, c);
  // The last columns (n not a multiple of 64), one at a time.
  for (; c < n; ++c) {
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = bias != nullptr ? bias[c] : 0.0f;
    for (int64_t i = 0; i < k; ++i) {
      for (int r = 0; r < R; ++r) acc[r] += x[r * k + i] * w[i * ld + c];
    }
    for (int r = 0; r < R; ++r) y[r * n + c] = acc[r];
  }
}

[[gnu::always_inline]] inline void Dispatch(int64_t rows, int64_t k, int64_t n, const float* x,
                                            const float* w, int64_t ld, const float* bias,
                                            float* y) {
  switch (rows) {
    case 1:
      return Body<1>(k, n, x, w, ld, bias, y);
    case 2:
      return Body<2>(k, n, x, w, ld, bias, y);
    case 3:
      return Body<3>(k, n, x, w, ld, bias, y);
    default:
      return Body<4>(k, n, x, w, ld, bias, y);
  }
}

using MatmulFn = void (*)(int64_t rows, int64_t k, int64_t n, const float* x, const float* w,
                          int64_t ld, const float* bias, float* y);

void Portable(int64_t rows, int64_t k, int64_t n, const float* x, const float* w, int64_t ld,
              const float* bias, float* y) {
  Dispatch(rows, k, n, x, w, ld, bias, y);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2,fma"))) void Avx2(int64_t rows, int64_t k, int64_t n, const float* x,
                                              const float* w, int64_t ld, const float* bias,
                                              float* y) {
  Dispatch(rows, k, n, x, w, ld, bias, y);
}

__attribute__((target("avx512f,avx2,fma"))) void Avx512(int64_t rows, int64_t k, int64_t n,
                                                        const float* x, const float* w, int64_t ld,
                                                        const float* bias, float* y) {
  Dispatch(rows, k, n, x, w, ld, bias, y);
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

void SmallMatmul(int64_t rows, int64_t k, int64_t n, const float* x, const float* w, int64_t ld,
                 const float* bias, float* y) {
  static const MatmulFn selected = Selected();
  selected(std::clamp<int64_t>(rows, 1, kSmallMatmulRows), k, n, x, w, ld, bias, y);
}

}  // namespace attnserve::core
