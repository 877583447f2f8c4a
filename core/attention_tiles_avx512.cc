// AVX-512 tile kernels (see attention_tiles.h). Only the functions marked ATTNSERVE_AVX512 use
// AVX-512 (per-function target attributes, no global -mavx512 flags), and they are reached only
// after a runtime CPU check, so the library still runs on any x86-64.
//
// Register blocking: a tile is kVecs (1..3) vectors of 16 query rows. The score kernel keeps
// 8 keys x kVecs accumulators (24 of 32 zmm at kVecs = 3), broadcasting one key element per
// FMA group; the accumulate kernel keeps 8 output columns x kVecs, broadcasting one value
// element per group. The softmax is vertical: per row state is one lane.
//
// The bf16 flavour (functions marked ATTNSERVE_AVX512_BF16, reached only where AVX512-BF16 is
// present) has the same blocking with vdpbf16ps, which adds the products of a pair of bf16s per
// 32-bit lane: queries and probabilities are stored as pairs of columns (keys) per lane, keys as
// bf16 rows, values as pairs of rows interleaved per column. Softmax and output stay f32.

// GCC 12's avx512fintrin.h seeds unmasked intrinsics with _mm512_undefined_ps(), which
// -W(maybe-)uninitialized reports at every inlined call site; the value is never read.
#if defined(__GNUC__) && !defined(__clang__)  // clang has no -Wmaybe-uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "core/attention_tiles.h"
#include "core/cpu_features.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTNSERVE_HAVE_AVX512_KERNELS 1
#else
#define ATTNSERVE_HAVE_AVX512_KERNELS 0
#endif

namespace attnserve::core::internal {

#if ATTNSERVE_HAVE_AVX512_KERNELS

#define ATTNSERVE_AVX512 __attribute__((target("avx512f")))
#define ATTNSERVE_AVX512_INLINE __attribute__((target("avx512f"), always_inline)) inline

namespace {

// 2^x for x <= 0, relative error below 2e-7: x = n + f with |f| <= 1/2, a degree-5 minimax
// polynomial for 2^f, and vscalefps for the 2^n (which flushes tiny results to 0 without
// needing exponent bit tricks). x is clamped at -120 so that 2^x never becomes denormal; a NaN
// stays NaN (vmaxps returns its second operand when one is NaN), so that a score that overflowed
// float32 reaches the output and the call is refused rather than answered without that key.
ATTNSERVE_AVX512_INLINE __m512 Exp2(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-120.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3266979925e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6754693954e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507426754e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022121576e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314694907e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000711e+00f));
  return _mm512_scalef_ps(p, n);
}

// Transposes the 16 x 16 block in r[0..15] in place (unpack, in-lane shuffle, two lane shuffles).
ATTNSERVE_AVX512_INLINE void Transpose16x16(__m512* r) {
  __m512 t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + m], 128-bit lane k: column 4k + m of rows 4i..4i+3.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512 even_lo = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);
    const __m512 even_hi = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
    const __m512 odd_lo = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
    const __m512 odd_hi = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD);
    r[4 + m] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD);
  }
}

// The first n lanes.
ATTNSERVE_AVX512_INLINE __mmask16 FirstLanes(int n) {
  return n >= kLanes ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1);
}

// Transposes the queries 16 x 16 blocks at a time; the row loads of a block are independent,
// so their cache misses overlap.
ATTNSERVE_AVX512 void PackQueries(const float* q, int64_t q_stride, int rows, int vecs,
                                  int head_dim, float factor, float* q_t) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int v = 0; v < vecs; ++v) {
    for (int c0 = 0; c0 < head_dim; c0 += kLanes) {
      const __mmask16 cols = FirstLanes(head_dim - c0);
      __m512 block[kLanes];
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) {
        const int r = v * kLanes + i;
        if (r >= rows) {
          block[i] = _mm512_setzero_ps();
        } else if (cols == 0xFFFF) {  // masked accesses that miss the cache are slow
          block[i] = _mm512_loadu_ps(q + r * q_stride + c0);
        } else {
          block[i] = _mm512_maskz_loadu_ps(cols, q + r * q_stride + c0);
        }
      }
      Transpose16x16(block);
      // Constant trip counts, tests inside: the block stays in registers.
#pragma GCC unroll 16
      for (int c = 0; c < kLanes; ++c) {
        if (c0 + c < head_dim) {
          _mm512_store_ps(q_t + (c0 + c) * kTileRows + v * kLanes, _mm512_mul_ps(block[c], f));
        }
      }
    }
  }
}

ATTNSERVE_AVX512 void StoreOutput(const float* out_t, const float* inv_sum, int rows, int head_dim,
                                  float* out, int64_t out_stride) {
  for (int v = 0; v * kLanes < rows; ++v) {
    const __m512 scale = _mm512_load_ps(inv_sum + v * kLanes);
    for (int c0 = 0; c0 < head_dim; c0 += kLanes) {
      const __mmask16 cols = FirstLanes(head_dim - c0);
      __m512 block[kLanes];
#pragma GCC unroll 16
      for (int c = 0; c < kLanes; ++c) {
        block[c] =
            c0 + c < head_dim
                ? _mm512_mul_ps(_mm512_load_ps(out_t + (c0 + c) * kTileRows + v * kLanes), scale)
                : _mm512_setzero_ps();
      }
      Transpose16x16(block);
      // Masked stores that miss the cache stall far longer than plain ones: use them for the
      // last columns only.
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) {
        if (v * kLanes + i >= rows) break;
        float* row = out + (v * kLanes + i) * out_stride + c0;
        if (cols == 0xFFFF) {
          _mm512_storeu_ps(row, block[i]);
        } else {
          _mm512_mask_storeu_ps(row, cols, block[i]);
        }
      }
    }
  }
}

// Asks for one row of a head's slice (head_dim floats) to be brought into cache.
ATTNSERVE_AVX512_INLINE void PrefetchRow(const float* row, int head_dim) {
  for (int c = 0; c < head_dim; c += kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(row + c), _MM_HINT_T0);
  }
}

// Lanes r of vector v that key j may be seen by: r >= diag + j (all lanes when not causal).
ATTNSERVE_AVX512_INLINE __mmask16 VisibleLanes(bool masked, int v, int64_t diag, int j) {
  if (!masked) return 0xFFFF;
  const int64_t first = diag + j - v * kLanes;  // first visible lane
  if (first <= 0) return 0xFFFF;
  if (first >= kLanes) return 0;
  return static_cast<__mmask16>(0xFFFF << first);
}

// acc[c][r] = the accumulator's columns [0, kCols), rows of vector r, times alpha: the old
// output rescaled to the block's new running max.
template <int kVecs, int kCols>
ATTNSERVE_AVX512_INLINE void LoadRescaled(const float* out_t, const float* alpha,
                                          __m512 (&acc)[kCols][kVecs]) {
  __m512 a[kVecs];
#pragma GCC unroll 3
  for (int r = 0; r < kVecs; ++r) a[r] = _mm512_load_ps(alpha + r * kLanes);
#pragma GCC unroll 8
  for (int c = 0; c < kCols; ++c) {
#pragma GCC unroll 3
    for (int r = 0; r < kVecs; ++r) {
      acc[c][r] = _mm512_mul_ps(_mm512_load_ps(out_t + c * kTileRows + r * kLanes), a[r]);
    }
  }
}

// Columns [0, kCols) of a transposed tile from registers (rows of vector r in acc[c][r]).
template <int kVecs, int kCols>
ATTNSERVE_AVX512_INLINE void StoreColumns(const __m512 (&acc)[kCols][kVecs], float* out_t) {
#pragma GCC unroll 8
  for (int c = 0; c < kCols; ++c) {
#pragma GCC unroll 3
    for (int r = 0; r < kVecs; ++r) _mm512_store_ps(out_t + c * kTileRows + r * kLanes, acc[c][r]);
  }
}

// Scores of 8 keys (pointers already clamped) against kVecs vectors of query rows.
template <int kVecs>
ATTNSERVE_AVX512 void ScoreKeyTile(const float* q_t, int head_dim, const float* const* keys,
                                   float* scores_t) {
  __m512 acc[kKeyTile][kVecs] = {};  // zeroed registers
  for (int c = 0; c < head_dim; ++c) {
    __m512 q[kVecs];
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) q[v] = _mm512_load_ps(q_t + c * kTileRows + v * kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < kKeyTile; ++j) {
      const __m512 kb = _mm512_set1_ps(keys[j][c]);
#pragma GCC unroll 3
      for (int v = 0; v < kVecs; ++v) acc[j][v] = _mm512_fmadd_ps(q[v], kb, acc[j][v]);
    }
  }
  StoreColumns<kVecs, kKeyTile>(acc, scores_t);
}

template <int kVecs>
ATTNSERVE_AVX512 void ScoreVecs(const float* q_t, int head_dim, const float* k, int64_t k_stride,
                                int num_keys, const NextBlock& next, float* scores_t) {
  for (int j0 = 0; j0 < num_keys; j0 += kKeyTile) {
    // The next block's K and V rows, a few per key tile so the requests spread over the block.
    for (int j = j0; j < j0 + kKeyTile && j < next.count; ++j) {
      PrefetchRow(next.k + j * next.k_stride, head_dim);
      PrefetchRow(next.v + j * next.v_stride, head_dim);
    }
    // Keys past the end repeat the last one: in bounds, and their scores are never read.
    const float* keys[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) keys[j] = k + std::min(j0 + j, num_keys - 1) * k_stride;
    ScoreKeyTile<kVecs>(q_t, head_dim, keys, scores_t + j0 * kTileRows);
  }
}

void Score(const float* q_t, int vecs, int head_dim, const void* k_rows, int64_t k_stride,
           int num_keys, const NextBlock& next, float* scores_t) {
  const float* k = static_cast<const float*>(k_rows);
  switch (vecs) {
    case 1:
      return ScoreVecs<1>(q_t, head_dim, k, k_stride, num_keys, next, scores_t);
    case 2:
      return ScoreVecs<2>(q_t, head_dim, k, k_stride, num_keys, next, scores_t);
    default:
      return ScoreVecs<3>(q_t, head_dim, k, k_stride, num_keys, next, scores_t);
  }
}

// New running max per vector over the visible scores of the block (two chains per vector
// so the max latency does not serialise the loop).
template <int kVecs>
ATTNSERVE_AVX512_INLINE void BlockMax(const float* scores_t, int num_keys, bool masked,
                                      int64_t diag, __m512* m) {
  __m512 m2[kVecs];
#pragma GCC unroll 3
  for (int v = 0; v < kVecs; ++v) m2[v] = m[v];
  int j = 0;
  for (; !masked && j + 1 < num_keys; j += 2) {
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) {
      m[v] = _mm512_max_ps(m[v], _mm512_load_ps(scores_t + j * kTileRows + v * kLanes));
      m2[v] = _mm512_max_ps(m2[v], _mm512_load_ps(scores_t + (j + 1) * kTileRows + v * kLanes));
    }
  }
  for (; j < num_keys; ++j) {
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) {
      const __m512 s = _mm512_load_ps(scores_t + j * kTileRows + v * kLanes);
      m[v] = _mm512_mask_max_ps(m[v], VisibleLanes(masked, v, diag, j), m[v], s);
    }
  }
#pragma GCC unroll 3
  for (int v = 0; v < kVecs; ++v) m[v] = _mm512_max_ps(m[v], m2[v]);
}

template <int kVecs>
ATTNSERVE_AVX512 void SoftmaxVecs(float* scores_t, int num_keys, bool causal, int64_t diag,
                                  float* max, float* sum, float* alpha) {
  // Only blocks crossing the diagonal need masks; the rest take the unmasked loops.
  const bool masked = causal && diag + num_keys - 1 > 0;
  __m512 m_old[kVecs], m[kVecs], block_sum[kVecs];
#pragma GCC unroll 3
  for (int v = 0; v < kVecs; ++v) {
    m_old[v] = _mm512_load_ps(max + v * kLanes);
    m[v] = m_old[v];
    block_sum[v] = _mm512_setzero_ps();
  }
  BlockMax<kVecs>(scores_t, num_keys, masked, diag, m);
  for (int j = 0; j < num_keys; ++j) {
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) {
      float* s = scores_t + j * kTileRows + v * kLanes;
      const __m512 e = Exp2(_mm512_sub_ps(_mm512_load_ps(s), m[v]));
      const __m512 p = _mm512_maskz_mov_ps(VisibleLanes(masked, v, diag, j), e);
      _mm512_store_ps(s, p);
      block_sum[v] = _mm512_add_ps(block_sum[v], p);
    }
  }
#pragma GCC unroll 3
  for (int v = 0; v < kVecs; ++v) {
    const __m512 a = Exp2(_mm512_sub_ps(m_old[v], m[v]));
    const __m512 l = _mm512_load_ps(sum + v * kLanes);
    _mm512_store_ps(alpha + v * kLanes, a);
    _mm512_store_ps(max + v * kLanes, m[v]);
    _mm512_store_ps(sum + v * kLanes, _mm512_fmadd_ps(l, a, block_sum[v]));
  }
}

void Softmax(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag, float* max,
             float* sum, float* alpha) {
  switch (vecs) {
    case 1:
      return SoftmaxVecs<1>(scores_t, num_keys, causal, diag, max, sum, alpha);
    case 2:
      return SoftmaxVecs<2>(scores_t, num_keys, causal, diag, max, sum, alpha);
    default:
      return SoftmaxVecs<3>(scores_t, num_keys, causal, diag, max, sum, alpha);
  }
}

// Output columns [0, kCols) of v: rescale by alpha, then add P V over the block's keys.
template <int kVecs, int kCols>
struct AccumulateCols {
  ATTNSERVE_AVX512 static void Run(const float* p_t, int num_keys, const float* v, int64_t v_stride,
                                   const float* alpha, float* out_t) {
    __m512 acc[kCols][kVecs];
    LoadRescaled<kVecs, kCols>(out_t, alpha, acc);
    for (int j = 0; j < num_keys; ++j) {
      __m512 p[kVecs];
#pragma GCC unroll 3
      for (int r = 0; r < kVecs; ++r) p[r] = _mm512_load_ps(p_t + j * kTileRows + r * kLanes);
      const float* value = v + j * v_stride;
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) {
        const __m512 vb = _mm512_set1_ps(value[c]);
#pragma GCC unroll 3
        for (int r = 0; r < kVecs; ++r) acc[c][r] = _mm512_fmadd_ps(p[r], vb, acc[c][r]);
      }
    }
    StoreColumns<kVecs, kCols>(acc, out_t);
  }
};

// Runs Cols<kVecs, 8>::Run over the output columns 8 at a time, then Cols<kVecs, n>::Run on the
// last n < 8: register blocks of a fixed width for any head_dim. `count` is what Cols steps over
// (keys, or key pairs for bf16), `stride` its distance in Values.
template <template <int, int> class Cols, int kVecs, typename Value>
void ByColumnBlocks(const float* p_t, int count, const Value* v, int64_t stride, int head_dim,
                    const float* alpha, float* out_t) {
  int c0 = 0;
  for (; c0 + 8 <= head_dim; c0 += 8) {
    Cols<kVecs, 8>::Run(p_t, count, v + c0, stride, alpha, out_t + c0 * kTileRows);
  }
  const Value* vc = v + c0;
  float* oc = out_t + c0 * kTileRows;
  switch (head_dim - c0) {
    case 1:
      return Cols<kVecs, 1>::Run(p_t, count, vc, stride, alpha, oc);
    case 2:
      return Cols<kVecs, 2>::Run(p_t, count, vc, stride, alpha, oc);
    case 3:
      return Cols<kVecs, 3>::Run(p_t, count, vc, stride, alpha, oc);
    case 4:
      return Cols<kVecs, 4>::Run(p_t, count, vc, stride, alpha, oc);
    case 5:
      return Cols<kVecs, 5>::Run(p_t, count, vc, stride, alpha, oc);
    case 6:
      return Cols<kVecs, 6>::Run(p_t, count, vc, stride, alpha, oc);
    case 7:
      return Cols<kVecs, 7>::Run(p_t, count, vc, stride, alpha, oc);
    default:
      return;
  }
}

void Accumulate(const float* p_t, int vecs, int num_keys, const void* v_rows, int64_t v_stride,
                int head_dim, const float* alpha, float* out_t) {
  const float* v = static_cast<const float*>(v_rows);
  switch (vecs) {
    case 1:
      return ByColumnBlocks<AccumulateCols, 1>(p_t, num_keys, v, v_stride, head_dim, alpha, out_t);
    case 2:
      return ByColumnBlocks<AccumulateCols, 2>(p_t, num_keys, v, v_stride, head_dim, alpha, out_t);
    default:
      return ByColumnBlocks<AccumulateCols, 3>(p_t, num_keys, v, v_stride, head_dim, alpha, out_t);
  }
}

ATTNSERVE_AVX512 void Normalize(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag,
                                const float* max, const float* inv_sum) {
  const bool masked = causal && diag + num_keys - 1 > 0;
  for (int j = 0; j < num_keys; ++j) {
    for (int v = 0; v < vecs; ++v) {
      float* s = scores_t + j * kTileRows + v * kLanes;
      const __m512 e = Exp2(_mm512_sub_ps(_mm512_load_ps(s), _mm512_load_ps(max + v * kLanes)));
      const __m512 p = _mm512_mul_ps(e, _mm512_load_ps(inv_sum + v * kLanes));
      _mm512_store_ps(s, _mm512_maskz_mov_ps(VisibleLanes(masked, v, diag, j), p));
    }
  }
}

constexpr TileKernels kAvx512Kernels{PackQueries, Score,       Softmax,
                                     Accumulate,  StoreOutput, Normalize};

// ---- bf16 products (vdpbf16ps) ----

#define ATTNSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define ATTNSERVE_AVX512_BF16_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline

// Lane i of the result holds bf16(even[i]) in its low half and bf16(odd[i]) in its high half,
// rounded to nearest even: one vdpbf16ps operand of 16 pairs.
ATTNSERVE_AVX512_BF16_INLINE __m512i PackPairs(__m512 even, __m512 odd) {
  // cvtne2ps puts even in bf16 elements 0..15 and odd in 16..31; interleave them.
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), halves);
}

// Rows 2i and 2i + 1 (the latter 0 past `count`) of a transposed tile become pair row i, in
// place: pair row i is written after rows 2i and 2i + 1 are read, and row i was read earlier.
ATTNSERVE_AVX512_BF16_INLINE void PairRows(float* t, int vecs, int count) {
  for (int i = 0; 2 * i < count; ++i) {
    for (int v = 0; v < vecs; ++v) {
      const __m512 even = _mm512_load_ps(t + 2 * i * kTileRows + v * kLanes);
      const __m512 odd = 2 * i + 1 < count
                             ? _mm512_load_ps(t + (2 * i + 1) * kTileRows + v * kLanes)
                             : _mm512_setzero_ps();
      _mm512_store_si512(t + i * kTileRows + v * kLanes, PackPairs(even, odd));
    }
  }
}

// The f32 transposed queries, then pairs of columns per lane.
ATTNSERVE_AVX512_BF16 void PackQueriesBf16(const float* q, int64_t q_stride, int rows, int vecs,
                                           int head_dim, float factor, float* q_t) {
  PackQueries(q, q_stride, rows, vecs, head_dim, factor, q_t);
  PairRows(q_t, vecs, head_dim);
}

// Keys as bf16 rows padded to an even width (the pad is 0), so a column pair is one 32-bit
// load; values as pair rows: lane c of pair row i is (v[2i][c], v[2i + 1][c]), the missing
// odd row of an odd count 0.
ATTNSERVE_AVX512_BF16 KeysValues PackKeysValuesBf16(const float* k, int64_t k_stride,
                                                    const float* v, int64_t v_stride, int64_t count,
                                                    int head_dim, void* k_out, void* v_out) {
  const int64_t k_width = (head_dim + 1) / 2 * 2;
  uint16_t* k16 = static_cast<uint16_t*>(k_out);
  for (int64_t j = 0; j < count; ++j) {
    if (j + 8 < count) PrefetchRow(k + (j + 8) * k_stride, head_dim);
    for (int c0 = 0; c0 < k_width; c0 += kLanes) {
      const __m512 x = _mm512_maskz_loadu_ps(FirstLanes(head_dim - c0), k + j * k_stride + c0);
      const __m256i bf = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
      _mm256_mask_storeu_epi16(k16 + j * k_width + c0, FirstLanes(k_width - c0), bf);
    }
  }
  uint32_t* v32 = static_cast<uint32_t*>(v_out);
  for (int64_t i = 0; 2 * i < count; ++i) {
    const float* even = v + 2 * i * v_stride;
    const bool has_odd = 2 * i + 1 < count;
    if (2 * i + 8 < count) {
      PrefetchRow(even + 8 * v_stride, head_dim);
      PrefetchRow(even + 9 * v_stride, head_dim);
    }
    for (int c0 = 0; c0 < head_dim; c0 += kLanes) {
      const __mmask16 cols = FirstLanes(head_dim - c0);
      const __m512 e = _mm512_maskz_loadu_ps(cols, even + c0);
      const __m512 o =
          has_odd ? _mm512_maskz_loadu_ps(cols, even + v_stride + c0) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(v32 + i * head_dim + c0, cols, PackPairs(e, o));
    }
  }
  // Strides per key: a key row of k_width bf16s; half a pair row (head_dim pairs) per value.
  return KeysValues{k_out, k_width, v_out, head_dim};
}

// Scores of 8 keys against kVecs vectors of query rows, a column pair per vdpbf16ps.
template <int kVecs>
ATTNSERVE_AVX512_BF16 void ScoreKeyTileBf16(const float* q_t, int pairs,
                                            const uint32_t* const* keys, float* scores_t) {
  __m512 acc[kKeyTile][kVecs] = {};  // zeroed registers
  for (int c = 0; c < pairs; ++c) {
    __m512bh q[kVecs];
#pragma GCC unroll 3
    for (int v = 0; v < kVecs; ++v) {
      q[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(q_t + c * kTileRows + v * kLanes));
    }
#pragma GCC unroll 8
    for (int j = 0; j < kKeyTile; ++j) {
      const __m512bh kb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(keys[j][c]));
#pragma GCC unroll 3
      for (int v = 0; v < kVecs; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], q[v], kb);
    }
  }
  StoreColumns<kVecs, kKeyTile>(acc, scores_t);
}

template <int kVecs>
ATTNSERVE_AVX512_BF16 void ScoreVecsBf16(const float* q_t, int head_dim, const uint16_t* k,
                                         int64_t k_stride, int num_keys, float* scores_t) {
  for (int j0 = 0; j0 < num_keys; j0 += kKeyTile) {
    // Keys past the end repeat the last one: in bounds, and their scores are never read.
    const uint32_t* keys[kKeyTile];
    for (int j = 0; j < kKeyTile; ++j) {
      keys[j] = reinterpret_cast<const uint32_t*>(k + std::min(j0 + j, num_keys - 1) * k_stride);
    }
    ScoreKeyTileBf16<kVecs>(q_t, (head_dim + 1) / 2, keys, scores_t + j0 * kTileRows);
  }
}

// Packed keys are contiguous: the hardware prefetcher sees them coming, `next` is not needed.
void ScoreBf16(const float* q_t, int vecs, int head_dim, const void* k_packed, int64_t k_stride,
               int num_keys, const NextBlock& /*next*/, float* scores_t) {
  const uint16_t* k = static_cast<const uint16_t*>(k_packed);
  switch (vecs) {
    case 1:
      return ScoreVecsBf16<1>(q_t, head_dim, k, k_stride, num_keys, scores_t);
    case 2:
      return ScoreVecsBf16<2>(q_t, head_dim, k, k_stride, num_keys, scores_t);
    default:
      return ScoreVecsBf16<3>(q_t, head_dim, k, k_stride, num_keys, scores_t);
  }
}

// The f32 online softmax; then the probabilities become pairs of keys per lane for P V. The
// running sum keeps the unrounded probabilities.
ATTNSERVE_AVX512_BF16 void SoftmaxBf16(float* scores_t, int vecs, int num_keys, bool causal,
                                       int64_t diag, float* max, float* sum, float* alpha) {
  Softmax(scores_t, vecs, num_keys, causal, diag, max, sum, alpha);
  PairRows(scores_t, vecs, num_keys);
}

// Output columns [0, kCols) of v: rescale by alpha, then add P V, a key pair per vdpbf16ps.
template <int kVecs, int kCols>
struct AccumulateColsBf16 {
  ATTNSERVE_AVX512_BF16 static void Run(const float* p_t, int pairs, const uint32_t* v,
                                        int64_t pair_stride, const float* alpha, float* out_t) {
    __m512 acc[kCols][kVecs];
    LoadRescaled<kVecs, kCols>(out_t, alpha, acc);
    for (int i = 0; i < pairs; ++i) {
      __m512bh p[kVecs];
#pragma GCC unroll 3
      for (int r = 0; r < kVecs; ++r) {
        p[r] = reinterpret_cast<__m512bh>(_mm512_load_si512(p_t + i * kTileRows + r * kLanes));
      }
      const uint32_t* value = v + i * pair_stride;
#pragma GCC unroll 8
      for (int c = 0; c < kCols; ++c) {
        const __m512bh vb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(value[c]));
#pragma GCC unroll 3
        for (int r = 0; r < kVecs; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], p[r], vb);
      }
    }
    StoreColumns<kVecs, kCols>(acc, out_t);
  }
};

// v_stride is per key (PackKeysValuesBf16): pair row i starts i * v_stride 32-bit lanes in.
void AccumulateBf16(const float* p_t, int vecs, int num_keys, const void* v_packed,
                    int64_t v_stride, int head_dim, const float* alpha, float* out_t) {
  const uint32_t* v = static_cast<const uint32_t*>(v_packed);
  const int pairs = (num_keys + 1) / 2;
  switch (vecs) {
    case 1:
      return ByColumnBlocks<AccumulateColsBf16, 1>(p_t, pairs, v, v_stride, head_dim, alpha, out_t);
    case 2:
      return ByColumnBlocks<AccumulateColsBf16, 2>(p_t, pairs, v, v_stride, head_dim, alpha, out_t);
    default:
      return ByColumnBlocks<AccumulateColsBf16, 3>(p_t, pairs, v, v_stride, head_dim, alpha, out_t);
  }
}

constexpr TileKernels kAvx512Bf16Kernels{PackQueriesBf16,
                                         ScoreBf16,
                                         SoftmaxBf16,
                                         AccumulateBf16,
                                         StoreOutput,
                                         Normalize,
                                         PackKeysValuesBf16,
                                         /*kv_element_bytes=*/2,
                                         /*unpacked_fallback=*/&kAvx512Kernels};

}  // namespace

const TileKernels* Avx512TileKernels() {
  static const bool supported = __builtin_cpu_supports("avx512f");
  return supported ? &kAvx512Kernels : nullptr;
}

const TileKernels* Avx512Bf16TileKernels() {
  static const bool supported = CpuHasAvx512Bf16();
  return supported ? &kAvx512Bf16Kernels : nullptr;
}

#else  // !ATTNSERVE_HAVE_AVX512_KERNELS

const TileKernels* Avx512TileKernels() { return nullptr; }
const TileKernels* Avx512Bf16TileKernels() { return nullptr; }

#endif

}  // namespace attnserve::core::internal
