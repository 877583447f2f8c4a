#include "core/kv_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/cpu_features.h"
#include "core/parallel_for.h"

// One body, compiled three times: for AVX-512, for AVX2 + FMA (per-function target attributes,
// no global flags) and portable; the widest the CPU has is chosen once at run time, as the
// attention tiles are (attention_tiles_avx512.cc). The body works on 16-float vectors (GCC and
// clang vector extensions): one zmm for AVX-512; for AVX2 a pair of 8-float vectors, one ymm each
// (Floats8x2, below); the portable flavour leaves them to the compiler. A fourth flavour, for CPUs
// with AVX512-BF16, multiplies a bf16 cache in bf16 with intrinsics of its own (see
// AttendTileBf16Dot).

// The helpers below pass 16-float vectors by value; they are always inlined, so GCC's note that
// such a signature's ABI differs with and without AVX-512 concerns no call that exists.
#pragma GCC diagnostic ignored "-Wpsabi"
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// GCC 12's avx512fintrin.h seeds unmasked intrinsics with _mm512_undefined_ps(), which
// -W(maybe-)uninitialized reports at every inlined call site; the value is never read.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

namespace attnserve::core {
namespace {

static_assert(kKvBlockTokens == 16, "a block's 16 keys are one 16-float vector");

typedef float Floats16 __attribute__((vector_size(64)));
typedef uint32_t Words16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));
typedef float Floats8 __attribute__((vector_size(32)));
typedef uint32_t Words8 __attribute__((vector_size(32)));
typedef int32_t Ints8 __attribute__((vector_size(32)));

// The AVX2 flavour's 16 floats (or words): two 8-lane halves, each one ymm register. GCC keeps a
// 16-lane vector type in memory on a target without 64-byte registers, so that every operation
// on it went through the stack: the AVX2 kernel ran at 7-8 GB/s a core whether its keys came from
// memory or the cache, slower than the portable one.
struct Floats8x2 {
  Floats8 lo, hi;
};
struct Words8x2 {
  Words8 lo, hi;
};
[[gnu::always_inline]] inline Floats8x2 operator+(const Floats8x2& a, const Floats8x2& b) {
  return {a.lo + b.lo, a.hi + b.hi};
}
[[gnu::always_inline]] inline Floats8x2& operator+=(Floats8x2& a, const Floats8x2& b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
[[gnu::always_inline]] inline Floats8x2 operator*(float s, const Floats8x2& a) {
  return {s * a.lo, s * a.hi};
}
[[gnu::always_inline]] inline Floats8x2 operator*(const Floats8x2& a, float s) {
  return {a.lo * s, a.hi * s};
}
[[gnu::always_inline]] inline Floats8x2 operator-(const Floats8x2& a, float s) {
  return {a.lo - s, a.hi - s};
}

// The words that hold 16 bf16 pairs beside each 16-float vector type.
template <typename V>
struct PairsOf;
template <>
struct PairsOf<Floats16> {
  using Type = Words16;
};
template <>
struct PairsOf<Floats8x2> {
  using Type = Words8x2;
};

// 16 floats from `p` (unaligned), and back.
template <typename V>
[[gnu::always_inline]] inline V Load16(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <>
[[gnu::always_inline]] inline Floats8x2 Load16<Floats8x2>(const float* p) {
  Floats8x2 v;
  __builtin_memcpy(&v.lo, p, sizeof(v.lo));
  __builtin_memcpy(&v.hi, p + 8, sizeof(v.hi));
  return v;
}
[[gnu::always_inline]] inline void Store16(float* p, const Floats16& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
[[gnu::always_inline]] inline void Store16(float* p, const Floats8x2& v) {
  __builtin_memcpy(p, &v.lo, sizeof(v.lo));
  __builtin_memcpy(p + 8, &v.hi, sizeof(v.hi));
}

// A bf16 cache's 64 bytes hold 32 values as 16 pairs (two dimensions of 16 keys, or 16
// dimensions of two rows): the first of each pair is the low half of a 32-bit lane, the second
// the high half, and a bf16 is the high half of its f32. One shift or one mask widens 16.
template <typename V>
[[gnu::always_inline]] inline typename PairsOf<V>::Type LoadPairs(const uint16_t* p) {
  typename PairsOf<V>::Type w;
  __builtin_memcpy(&w, p, sizeof(w));
  return w;
}
template <>
[[gnu::always_inline]] inline Words8x2 LoadPairs<Floats8x2>(const uint16_t* p) {
  Words8x2 w;
  __builtin_memcpy(&w.lo, p, sizeof(w.lo));
  __builtin_memcpy(&w.hi, p + 16, sizeof(w.hi));
  return w;
}
template <typename F, typename W>
[[gnu::always_inline]] inline F FirstOf(const W& w) {
  const W bits = w << 16;
  F f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename F, typename W>
[[gnu::always_inline]] inline F SecondOf(const W& w) {
  const W bits = w & 0xffff0000u;
  F f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
[[gnu::always_inline]] inline Floats16 First(const Words16& w) { return FirstOf<Floats16>(w); }
[[gnu::always_inline]] inline Floats16 Second(const Words16& w) { return SecondOf<Floats16>(w); }
[[gnu::always_inline]] inline Floats8x2 First(const Words8x2& w) {
  return {FirstOf<Floats8>(w.lo), FirstOf<Floats8>(w.hi)};
}
[[gnu::always_inline]] inline Floats8x2 Second(const Words8x2& w) {
  return {SecondOf<Floats8>(w.lo), SecondOf<Floats8>(w.hi)};
}

inline float Widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x = e^x, elementwise, for -87 <= x <= 0 (scores less their maximum; below -87 it gives e^-87
// rather than 0, a weight of 1.6e-38 against the maximum's 1), within a few ulp of std::exp.
template <typename F, typename I>
[[gnu::always_inline]] inline void ExpLanes(F& x) {
  x = x < -87.0f ? F{} - 87.0f : x;
  // e^x = 2^n * e^f with n = round(x / ln 2); f = x - n ln 2 in two parts (Cody and Waite), so
  // that the reduction adds no rounding error of its own. x - 0.5 ln 2 < 0: truncation rounds.
  const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);
  const F nf = __builtin_convertvector(n, F);
  const F f = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  // e^f for |f| <= ln(2) / 2, Taylor to f^7 (error below 2e-8 relative).
  F p = 1.0f / 5040 + f * (1.0f / 40320);
  p = 1.0f / 720 + f * p;
  p = 1.0f / 120 + f * p;
  p = 1.0f / 24 + f * p;
  p = 1.0f / 6 + f * p;
  p = 0.5f + f * p;
  p = 1.0f + f * p;
  p = 1.0f + f * p;
  const I scale_bits = (n + 127) << 23;  // 2^n, n >= -126
  F two_n;
  __builtin_memcpy(&two_n, &scale_bits, sizeof(two_n));
  x = p * two_n;
}
[[gnu::always_inline]] inline void Exp16(Floats16& x) { ExpLanes<Floats16, Ints16>(x); }
[[gnu::always_inline]] inline void Exp16(Floats8x2& x) {
  ExpLanes<Floats8, Ints8>(x.lo);
  ExpLanes<Floats8, Ints8>(x.hi);
}

// The online softmax's rescale of what a head has summed when a block raises its maximum from
// `running_max` to `block_max`: e^(running_max - block_max). Past the first few blocks the
// maximum seldom moves, and e^0 is 1 exactly, so std::exp's call is saved there: the f32
// kernel's attention took 0.19-0.20 ms instead of 0.25-0.30 with the keys in the CPU's caches
// (4 sequences at 576 cached, one thread), a few percent less from memory; the bf16 kernel,
// whose heads' exponentials overlap their products, no different.
[[gnu::always_inline]] inline float Correction(float running_max, float block_max) {
  return running_max == block_max ? 1.0f : std::exp(running_max - block_max);
}

// Elements of one head's keys in a block: bf16 keys pair dimensions, an odd last one padded.
template <typename T>
constexpr int64_t KeyElements(int64_t head_dim) {
  return (sizeof(T) == 2 ? (head_dim + 1) / 2 * 2 : head_dim) * kKvBlockTokens;
}

// The 16 keys' dot products with q: keys column-major ([head_dim][16]), so one vector FMA a
// dimension, in four independent chains.
template <typename V>
[[gnu::always_inline]] inline V Scores(const float* q, const float* keys, int64_t head_dim) {
  V dots0 = {}, dots1 = {}, dots2 = {}, dots3 = {};
  int64_t d = 0;
  for (; d + 4 <= head_dim; d += 4) {
    dots0 += q[d] * Load16<V>(keys + d * kKvBlockTokens);
    dots1 += q[d + 1] * Load16<V>(keys + (d + 1) * kKvBlockTokens);
    dots2 += q[d + 2] * Load16<V>(keys + (d + 2) * kKvBlockTokens);
    dots3 += q[d + 3] * Load16<V>(keys + (d + 3) * kKvBlockTokens);
  }
  for (; d < head_dim; ++d) dots0 += q[d] * Load16<V>(keys + d * kKvBlockTokens);
  return (dots0 + dots1) + (dots2 + dots3);
}

// bf16 keys in dimension pairs ([head_dim / 2][16][2]): one load, a shift and a mask give two
// dimensions of the 16 keys.
template <typename V>
[[gnu::always_inline]] inline V Scores(const float* q, const uint16_t* keys, int64_t head_dim) {
  V dots0 = {}, dots1 = {}, dots2 = {}, dots3 = {};
  constexpr int64_t kPair = 2 * kKvBlockTokens;  // elements of one dimension pair
  int64_t d = 0;
  for (; d + 4 <= head_dim; d += 4) {
    const auto w0 = LoadPairs<V>(keys + d / 2 * kPair);
    const auto w1 = LoadPairs<V>(keys + (d / 2 + 1) * kPair);
    dots0 += q[d] * First(w0);
    dots1 += q[d + 1] * Second(w0);
    dots2 += q[d + 2] * First(w1);
    dots3 += q[d + 3] * Second(w1);
  }
  for (; d + 2 <= head_dim; d += 2) {
    const auto w = LoadPairs<V>(keys + d / 2 * kPair);
    dots0 += q[d] * First(w);
    dots1 += q[d + 1] * Second(w);
  }
  if (d < head_dim) dots0 += q[d] * First(LoadPairs<V>(keys + d / 2 * kPair));
  return (dots0 + dots1) + (dots2 + dots3);
}

// acc = acc * correction + sum over the block's rows of weights[r] * values[r]: f32 values
// row-major ([16][head_dim]), four 16-dimension slices at a time, their accumulators held in
// registers across the rows.
template <typename V>
[[gnu::always_inline]] inline void AddValues(const float* weights, const float* values,
                                             int64_t rows, int64_t head_dim, float correction,
                                             float* acc) {
  const int64_t slices = head_dim / 16 * 16;  // dimensions in whole 16-float slices
  int64_t c = 0;
  for (; c + 64 <= slices; c += 64) {
    V a0 = Load16<V>(acc + c) * correction, a1 = Load16<V>(acc + c + 16) * correction;
    V a2 = Load16<V>(acc + c + 32) * correction, a3 = Load16<V>(acc + c + 48) * correction;
    for (int64_t r = 0; r < rows; ++r) {
      const float* v = values + r * head_dim + c;
      a0 += weights[r] * Load16<V>(v);
      a1 += weights[r] * Load16<V>(v + 16);
      a2 += weights[r] * Load16<V>(v + 32);
      a3 += weights[r] * Load16<V>(v + 48);
    }
    Store16(acc + c, a0);
    Store16(acc + c + 16, a1);
    Store16(acc + c + 32, a2);
    Store16(acc + c + 48, a3);
  }
  for (; c < slices; c += 16) {
    V a = Load16<V>(acc + c) * correction;
    for (int64_t r = 0; r < rows; ++r) a += weights[r] * Load16<V>(values + r * head_dim + c);
    Store16(acc + c, a);
  }
  for (; c < head_dim; ++c) {
    float a = acc[c] * correction;
    for (int64_t r = 0; r < rows; ++r) a += weights[r] * values[r * head_dim + c];
    acc[c] = a;
  }
}

// The same for bf16 values in row pairs ([8][head_dim][2]): one load, a shift and a mask give
// 16 dimensions of two rows. A last odd row is read alone: the row after it was never written.
template <typename V>
[[gnu::always_inline]] inline void AddValues(const float* weights, const uint16_t* values,
                                             int64_t rows, int64_t head_dim, float correction,
                                             float* acc) {
  const int64_t slices = head_dim / 16 * 16;
  const int64_t pairs = rows / 2;
  const int64_t pair_stride = 2 * head_dim;  // elements of one row pair
  int64_t c = 0;
  for (; c + 64 <= slices; c += 64) {
    V a0 = Load16<V>(acc + c) * correction, a1 = Load16<V>(acc + c + 16) * correction;
    V a2 = Load16<V>(acc + c + 32) * correction, a3 = Load16<V>(acc + c + 48) * correction;
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* v = values + p * pair_stride + 2 * c;
      const float we = weights[2 * p], wo = weights[2 * p + 1];
      const auto w0 = LoadPairs<V>(v), w1 = LoadPairs<V>(v + 32);
      const auto w2 = LoadPairs<V>(v + 64), w3 = LoadPairs<V>(v + 96);
      a0 += we * First(w0) + wo * Second(w0);
      a1 += we * First(w1) + wo * Second(w1);
      a2 += we * First(w2) + wo * Second(w2);
      a3 += we * First(w3) + wo * Second(w3);
    }
    if (rows % 2 != 0) {
      const uint16_t* v = values + pairs * pair_stride + 2 * c;
      const float we = weights[rows - 1];
      a0 += we * First(LoadPairs<V>(v));
      a1 += we * First(LoadPairs<V>(v + 32));
      a2 += we * First(LoadPairs<V>(v + 64));
      a3 += we * First(LoadPairs<V>(v + 96));
    }
    Store16(acc + c, a0);
    Store16(acc + c + 16, a1);
    Store16(acc + c + 32, a2);
    Store16(acc + c + 48, a3);
  }
  for (; c < slices; c += 16) {
    V a = Load16<V>(acc + c) * correction;
    for (int64_t p = 0; p < pairs; ++p) {
      const auto w = LoadPairs<V>(values + p * pair_stride + 2 * c);
      a += weights[2 * p] * First(w) + weights[2 * p + 1] * Second(w);
    }
    if (rows % 2 != 0)
      a += weights[rows - 1] * First(LoadPairs<V>(values + pairs * pair_stride + 2 * c));
    Store16(acc + c, a);
  }
  for (; c < head_dim; ++c) {
    float a = acc[c] * correction;
    for (int64_t r = 0; r < rows; ++r) {
      a += weights[r] * Widen(values[r / 2 * pair_stride + 2 * c + r % 2]);
    }
    acc[c] = a;
  }
}

// One head's online softmax so far: the running maximum and sum, and the weighted values.
struct HeadState {
  float running_max;
  float running_sum;
  float* acc;  // [head_dim]
};

// One head of one query over one block's `rows` keys and values, T (float or bf16) storage,
// folded into `state`: the 16 scores side by side (Scores, in vectors V), their exponentials as
// one vector, the online softmax's rescale once, then the weighted values (AddValues).
template <typename V, typename T>
[[gnu::always_inline]] inline void AttendBlock(const float* q, const T* keys, int64_t rows,
                                               int64_t head_dim, HeadState& state) {
  const T* values = keys + KeyElements<T>(head_dim);
  alignas(64) float scores[kKvBlockTokens];
  Store16(scores, Scores<V>(q, keys, head_dim));
  float block_max = state.running_max;
  for (int64_t r = 0; r < rows; ++r) block_max = std::max(block_max, scores[r]);
  // Rows past the visible ones hold whatever the block holds there: never used, but kept
  // finite for the exponential.
  for (int64_t r = rows; r < kKvBlockTokens; ++r) scores[r] = block_max;
  const float correction = Correction(state.running_max, block_max);
  state.running_max = block_max;
  alignas(64) float weights[kKvBlockTokens];
  V exps = Load16<V>(scores) - block_max;
  Exp16(exps);
  Store16(weights, exps);
  float block_sum = 0.0f;
  for (int64_t r = 0; r < rows; ++r) block_sum += weights[r];
  state.running_sum = state.running_sum * correction + block_sum;
  AddValues<V>(weights, values, rows, head_dim, correction, state.acc);
}

// Each (query, head) state of a tile starts empty, its weighted values in `acc`; returns the most
// keys any query of the tile sees.
[[gnu::always_inline]] inline int64_t StartStates(const KvQuery* queries, int64_t count,
                                                  int64_t heads, int64_t head_dim, float* acc,
                                                  HeadState* states) {
  std::fill(acc, acc + count * heads * head_dim, 0.0f);
  int64_t visible = 0;
  for (int64_t t = 0; t < count; ++t) {
    visible = std::max(visible, queries[t].visible);
    for (int64_t h = 0; h < heads; ++h) {
      states[t * heads + h] = {-std::numeric_limits<float>::infinity(), 0.0f,
                               acc + (t * heads + h) * head_dim};
    }
  }
  return visible;
}

// Each query's output, heads first_head .., from the tile's states: the weighted values over the
// softmax's sum (0 for a query that sees no key).
[[gnu::always_inline]] inline void WriteOutputs(const KvQuery* queries, int64_t count,
                                                int64_t first_head, int64_t heads, int64_t head_dim,
                                                const HeadState* states) {
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const HeadState& state = states[t * heads + h];
      const float inverse = queries[t].visible > 0 ? 1.0f / state.running_sum : 0.0f;
      float* out = queries[t].out + (first_head + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) out[d] = state.acc[d] * inverse;
    }
  }
}

// The most queries a tile takes, and the most dimensions (queries x heads x head_dim) and
// (query, head) states a tile's group of heads spans: its state lives on the stack.
constexpr int64_t kMaxTileQueries = 8;
constexpr int64_t kMaxTileDims = kMaxDecodeHeadDim;  // one query of one head at least
constexpr int64_t kMaxTileStates = 128;

// A tile of `count` queries of one sequence (consecutive new tokens of a prompt's chunk, or one
// query), heads first_head .. first_head + heads - 1, over their visible keys, block by block:
// the group's parts of a block lie side by side, so each block is read as one stream, once for
// all the tile's queries. The hardware prefetchers follow that stream; asking for the next
// blocks in software as well (every line of a block at once) made the step slower, 0.80-0.84
// of a read stream's rate instead of 0.91-0.96.
template <typename V, typename T>
[[gnu::always_inline]] inline void AttendTileBody(const KvQuery* queries, int64_t count,
                                                  int64_t first_head, int64_t heads,
                                                  int64_t head_dim, float scale) {
  const KvSequence& kv = *queries[0].kv;
  alignas(64) float acc[kMaxTileDims];
  HeadState states[kMaxTileStates];
  const int64_t visible = StartStates(queries, count, heads, head_dim, acc, states);
  // The queries times the scale, as Forward's tiles take them: the scores then overflow float32
  // where Forward's do (within log2 e: Forward's carry it too, for exp2), not ten times sooner.
  alignas(64) float scaled[kMaxTileDims];
  for (int64_t t = 0; t < count; ++t) {
    const float* q = queries[t].q + first_head * head_dim;
    for (int64_t e = 0; e < heads * head_dim; ++e) scaled[t * heads * head_dim + e] = q[e] * scale;
  }
  const int64_t head_elements = kv.head_bytes() / static_cast<int64_t>(sizeof(T));
  for (int64_t start = 0; start < visible; start += kKvBlockTokens) {
    const int64_t block = start / kKvBlockTokens;
    const T* part = static_cast<const T*>(kv.head(block, first_head));
    for (int64_t t = 0; t < count; ++t) {
      const int64_t rows = std::min(kKvBlockTokens, queries[t].visible - start);
      if (rows <= 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        AttendBlock<V, T>(scaled + (t * heads + h) * head_dim, part + h * head_elements, rows,
                          head_dim, states[t * heads + h]);
      }
    }
  }
  WriteOutputs(queries, count, first_head, heads, head_dim, states);
}

using AttendFn = void (*)(const KvQuery* queries, int64_t count, int64_t first_head, int64_t heads,
                          int64_t head_dim, float scale);

template <typename T>
void AttendTilePortable(const KvQuery* queries, int64_t count, int64_t first_head, int64_t heads,
                        int64_t head_dim, float scale) {
  AttendTileBody<Floats16, T>(queries, count, first_head, heads, head_dim, scale);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <typename T>
__attribute__((target("avx2,fma"))) void AttendTileAvx2(const KvQuery* queries, int64_t count,
                                                        int64_t first_head, int64_t heads,
                                                        int64_t head_dim, float scale) {
  AttendTileBody<Floats8x2, T>(queries, count, first_head, heads, head_dim, scale);
}

template <typename T>
__attribute__((target("avx512f,avx2,fma"))) void AttendTileAvx512(const KvQuery* queries,
                                                                  int64_t count, int64_t first_head,
                                                                  int64_t heads, int64_t head_dim,
                                                                  float scale) {
  AttendTileBody<Floats16, T>(queries, count, first_head, heads, head_dim, scale);
}

// The AVX512-BF16 flavour of the bf16 kernel: vdpbf16ps adds the products of a lane's two bf16s
// to an f32, so a block's keys (dimension pairs) and values (row pairs) are used as stored, with
// no widening. Its other operands are rounded to bf16 for it, as in the bf16 attention tiles of a
// one-shot call: each query's head (once a tile) and each block's softmax weights; the scores,
// the softmax and the sums stay f32. Every function that uses the intrinsics carries the target
// (an always-inline helper with AVX512-BF16 cannot be inlined into the portable body above), so
// the tile's loop over blocks is written again for it; what it shares with the body has no
// target and is inlined into both.
#define ATTNSERVE_KV_BF16DOT \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define ATTNSERVE_KV_BF16DOT_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"), always_inline)) inline

// The first n of 16 lanes (all of them for n >= 16).
ATTNSERVE_KV_BF16DOT_INLINE __mmask16 FirstLanes(int64_t n) {
  return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1);
}

// n floats times `factor`, rounded (to nearest even) to bf16 pairs, in order: word i of `out`
// holds elements 2i and 2i + 1, the last of an odd n padded with 0. Writes (n + 1) / 2 words.
ATTNSERVE_KV_BF16DOT_INLINE void RoundToBf16(const float* x, int64_t n, float factor,
                                             uint32_t* out) {
  const int64_t elements = (n + 1) / 2 * 2;
  for (int64_t i = 0; i < elements; i += 16) {
    const __m512 scaled =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(FirstLanes(n - i), x + i), _mm512_set1_ps(factor));
    const __m256bh rounded = _mm512_cvtneps_pbh(scaled);
    __m256i bits;
    __builtin_memcpy(&bits, &rounded, sizeof(bits));
    _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(out) + i, FirstLanes(elements - i), bits);
  }
}

// 16 floats rounded to bf16 pairs (8 words).
ATTNSERVE_KV_BF16DOT_INLINE void RoundToBf16(__m512 x, uint32_t* out) {
  const __m256bh rounded = _mm512_cvtneps_pbh(x);
  __builtin_memcpy(out, &rounded, sizeof(rounded));
}

// acc + the products of `pairs` (16 lanes of two bf16) and the pair `word` in every lane.
ATTNSERVE_KV_BF16DOT_INLINE __m512 DotAdd(__m512 acc, __m512i pairs, uint32_t word) {
  __m512bh a, b;
  const __m512i broadcast = _mm512_set1_epi32(static_cast<int>(word));
  __builtin_memcpy(&a, &pairs, sizeof(a));
  __builtin_memcpy(&b, &broadcast, sizeof(b));
  return _mm512_dpbf16_ps(acc, a, b);
}

// A pair whose second half was never written (an odd head_dim's last key dimension, an odd last
// row of values): only its first half, the second made 0.
ATTNSERVE_KV_BF16DOT_INLINE __m512i FirstHalves(const uint16_t* p) {
  return _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(0xffff));
}

// The 16 keys' scores with a query head rounded to bf16 pairs (`q`, (head_dim + 1) / 2 words).
ATTNSERVE_KV_BF16DOT_INLINE __m512 ScoresDot(const uint32_t* q, const uint16_t* keys,
                                             int64_t head_dim) {
  constexpr int64_t kPair = 2 * kKvBlockTokens;
  __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
  const int64_t pairs = head_dim / 2;
  int64_t p = 0;
  for (; p + 4 <= pairs; p += 4) {
    d0 = DotAdd(d0, _mm512_loadu_si512(keys + p * kPair), q[p]);
    d1 = DotAdd(d1, _mm512_loadu_si512(keys + (p + 1) * kPair), q[p + 1]);
    d2 = DotAdd(d2, _mm512_loadu_si512(keys + (p + 2) * kPair), q[p + 2]);
    d3 = DotAdd(d3, _mm512_loadu_si512(keys + (p + 3) * kPair), q[p + 3]);
  }
  for (; p < pairs; ++p) d0 = DotAdd(d0, _mm512_loadu_si512(keys + p * kPair), q[p]);
  if (head_dim % 2 != 0) d1 = DotAdd(d1, FirstHalves(keys + pairs * kPair), q[pairs]);
  return _mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3));
}

// acc = acc * correction + the rows' values weighted by `w` (the block's weights rounded to bf16
// pairs: word p holds rows 2p and 2p + 1).
ATTNSERVE_KV_BF16DOT_INLINE void AddValuesDot(const uint32_t* w, const uint16_t* values,
                                              int64_t rows, int64_t head_dim, float correction,
                                              float* acc) {
  const int64_t slices = head_dim / 16 * 16;
  const int64_t pairs = rows / 2;
  const int64_t pair_stride = 2 * head_dim;
  const __m512 c_ = _mm512_set1_ps(correction);
  int64_t c = 0;
  for (; c + 64 <= slices; c += 64) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + c), c_);
    __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 16), c_);
    __m512 a2 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 32), c_);
    __m512 a3 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 48), c_);
    for (int64_t p = 0; p < pairs; ++p) {
      const uint16_t* v = values + p * pair_stride + 2 * c;
      a0 = DotAdd(a0, _mm512_loadu_si512(v), w[p]);
      a1 = DotAdd(a1, _mm512_loadu_si512(v + 32), w[p]);
      a2 = DotAdd(a2, _mm512_loadu_si512(v + 64), w[p]);
      a3 = DotAdd(a3, _mm512_loadu_si512(v + 96), w[p]);
    }
    if (rows % 2 != 0) {
      const uint16_t* v = values + pairs * pair_stride + 2 * c;
      a0 = DotAdd(a0, FirstHalves(v), w[pairs]);
      a1 = DotAdd(a1, FirstHalves(v + 32), w[pairs]);
      a2 = DotAdd(a2, FirstHalves(v + 64), w[pairs]);
      a3 = DotAdd(a3, FirstHalves(v + 96), w[pairs]);
    }
    _mm512_storeu_ps(acc + c, a0);
    _mm512_storeu_ps(acc + c + 16, a1);
    _mm512_storeu_ps(acc + c + 32, a2);
    _mm512_storeu_ps(acc + c + 48, a3);
  }
  for (; c < slices; c += 16) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + c), c_);
    for (int64_t p = 0; p < pairs; ++p) {
      a = DotAdd(a, _mm512_loadu_si512(values + p * pair_stride + 2 * c), w[p]);
    }
    if (rows % 2 != 0) a = DotAdd(a, FirstHalves(values + pairs * pair_stride + 2 * c), w[pairs]);
    _mm512_storeu_ps(acc + c, a);
  }
  for (; c < head_dim; ++c) {
    float a = acc[c] * correction;
    for (int64_t r = 0; r < rows; ++r) {
      const auto weight = static_cast<uint16_t>(w[r / 2] >> (16 * (r % 2)));
      a += Widen(weight) * Widen(values[r / 2 * pair_stride + 2 * c + r % 2]);
    }
    acc[c] = a;
  }
}

// AttendTileBody for a bf16 cache, with vdpbf16ps (q_pairs' bound: Attend keeps count x heads x
// head_dim <= kMaxTileDims and count x heads <= kMaxTileStates).
ATTNSERVE_KV_BF16DOT void AttendTileBf16Dot(const KvQuery* queries, int64_t count,
                                            int64_t first_head, int64_t heads, int64_t head_dim,
                                            float scale) {
  const KvSequence& kv = *queries[0].kv;
  alignas(64) float acc[kMaxTileDims];
  HeadState states[kMaxTileStates];
  const int64_t visible = StartStates(queries, count, heads, head_dim, acc, states);
  // Each query head times the scale (as in AttendTileBody), rounded to bf16 pairs,
  // (head_dim + 1) / 2 words apart: at most
  // (count x heads x head_dim + count x heads) / 2 words.
  const int64_t q_words = (head_dim + 1) / 2;
  alignas(64) uint32_t q_pairs[(kMaxTileDims + kMaxTileStates) / 2];
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      RoundToBf16(queries[t].q + (first_head + h) * head_dim, head_dim, scale,
                  q_pairs + (t * heads + h) * q_words);
    }
  }
  // A block's scores, rescale factors and weights (bf16 pairs) for kPhaseHeads heads of a query.
  constexpr int64_t kPhaseHeads = 16;
  __m512 scores[kPhaseHeads];
  float corrections[kPhaseHeads];
  alignas(64) uint32_t weights[kPhaseHeads * kKvBlockTokens / 2];
  const int64_t head_elements = kv.head_bytes() / static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t start = 0; start < visible; start += kKvBlockTokens) {
    const int64_t block = start / kKvBlockTokens;
    const uint16_t* part = static_cast<const uint16_t*>(kv.head(block, first_head));
    for (int64_t t = 0; t < count; ++t) {
      const int64_t rows = std::min(kKvBlockTokens, queries[t].visible - start);
      if (rows <= 0) continue;
      // Each step for every head (up to kPhaseHeads at a time) before the next step, so that the
      // heads' dependency chains overlap: the 16 scores, then the online softmax (the weights
      // rounded to bf16 pairs), then the weighted values. (1.4 times as fast as a head at a time
      // from memory; the same order made the f32 kernel above slower.)
      const __mmask16 lanes = FirstLanes(rows);
      for (int64_t first = 0; first < heads; first += kPhaseHeads) {
        const int64_t n = std::min(kPhaseHeads, heads - first);
        HeadState* state = states + t * heads + first;
        const uint16_t* keys = part + first * head_elements;
        for (int64_t h = 0; h < n; ++h) {
          scores[h] = ScoresDot(q_pairs + (t * heads + first + h) * q_words,
                                keys + h * head_elements, head_dim);
        }
        for (int64_t h = 0; h < n; ++h) {
          const float block_max =
              std::max(state[h].running_max, _mm512_mask_reduce_max_ps(lanes, scores[h]));
          corrections[h] = Correction(state[h].running_max, block_max);
          state[h].running_max = block_max;
          // Rows past the visible ones hold whatever the block holds there: weighted 0.
          Floats16 exps =
              Floats16(_mm512_maskz_sub_ps(lanes, scores[h], _mm512_set1_ps(block_max)));
          Exp16(exps);
          const __m512 e = _mm512_maskz_mov_ps(lanes, __m512(exps));
          state[h].running_sum = state[h].running_sum * corrections[h] + _mm512_reduce_add_ps(e);
          RoundToBf16(e, weights + h * kKvBlockTokens / 2);
        }
        for (int64_t h = 0; h < n; ++h) {
          AddValuesDot(weights + h * kKvBlockTokens / 2,
                       keys + h * head_elements + KeyElements<uint16_t>(head_dim), rows, head_dim,
                       corrections[h], state[h].acc);
        }
      }
    }
  }
  WriteOutputs(queries, count, first_head, heads, head_dim, states);
}
#endif

// One flavour: its name and its kernel for each storage.
struct Flavour {
  const char* name;
  AttendFn f32;
  AttendFn bf16;
};

// The flavours this CPU runs, widest first.
std::vector<Flavour> Flavours() {
  std::vector<Flavour> flavours;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (CpuHasAvx512Bf16()) {
    flavours.push_back({"avx512bf16", &AttendTileAvx512<float>, &AttendTileBf16Dot});
  }
  if (__builtin_cpu_supports("avx512f")) {
    flavours.push_back({"avx512", &AttendTileAvx512<float>, &AttendTileAvx512<uint16_t>});
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    flavours.push_back({"avx2", &AttendTileAvx2<float>, &AttendTileAvx2<uint16_t>});
  }
#endif
  flavours.push_back({"portable", &AttendTilePortable<float>, &AttendTilePortable<uint16_t>});
  return flavours;
}

// The widest, unless ATTNSERVE_ATTENTION_KERNEL names another this CPU runs ("portable", as for
// the attention tiles; or "avx512", the f32-product kernel on a CPU with AVX512-BF16): to compare
// on one machine.
const Flavour& Selected() {
  static const Flavour selected = [] {
    const char* forced = std::getenv("ATTNSERVE_ATTENTION_KERNEL");
    const std::vector<Flavour> flavours = Flavours();
    for (const Flavour& flavour : flavours) {
      if (forced != nullptr && std::strcmp(forced, flavour.name) == 0) return flavour;
    }
    return flavours.front();
  }();
  return selected;
}

void Attend(const Flavour& flavour, std::span<const KvQuery> queries, int64_t num_heads,
            int64_t head_dim, float scale) {
  int64_t reads = 0;  // keys read in all: a team is worth starting only for enough of them
  for (const KvQuery& query : queries) reads += query.visible;
  const bool parallel = reads * num_heads * head_dim > (1 << 16);
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  // Tiles: consecutive queries of one sequence (a prompt's chunk) share each block read, up to
  // kMaxTileQueries, as many as the stack state allows for one head; a step's one token a
  // sequence is a tile of one.
  const int64_t per_tile =
      std::clamp<int64_t>(std::min(kMaxTileDims / head_dim, kMaxTileStates), 1, kMaxTileQueries);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // first query, count
  for (int64_t i = 0; i < static_cast<int64_t>(queries.size()); ++i) {
    if (!tiles.empty() && tiles.back().second < per_tile &&
        queries[tiles.back().first].kv == queries[i].kv) {
      ++tiles.back().second;
    } else {
      tiles.emplace_back(i, 1);
    }
  }
  int64_t longest = 1;
  for (const auto& tile : tiles) longest = std::max(longest, tile.second);
  // An item is a tile's group of heads: every head (each block read as one stream) when there
  // are enough tiles to share among the threads, else fewer heads an item; as many as the stack
  // state allows for the longest tile.
  int64_t group = std::clamp<int64_t>(
      std::min({num_heads, kMaxTileStates / longest, kMaxTileDims / (longest * head_dim)}), 1,
      num_heads);
  const int64_t tiles_n = static_cast<int64_t>(tiles.size());
  while (threads > 1 && group > 1 && tiles_n * ((num_heads + group - 1) / group) < 4 * threads) {
    group /= 2;
  }
  const int64_t groups = (num_heads + group - 1) / group;
  const int64_t items = tiles_n * groups;
  ParallelFor(
      parallel, items,
      [&](int64_t item) {
        const auto [first_query, count] = tiles[item / groups];
        const KvQuery* tile = queries.data() + first_query;
        const int64_t first = item % groups * group;
        (tile->kv->precision() == KvPrecision::kBF16 ? flavour.bf16 : flavour.f32)(
            tile, count, first, std::min(group, num_heads - first), head_dim, scale);
      },
      LoopSchedule::kDynamic);
}

}  // namespace

void KvAttention(std::span<const KvQuery> queries, int64_t num_heads, int64_t head_dim,
                 float scale) {
  Attend(Selected(), queries, num_heads, head_dim, scale);
}

std::vector<std::string> KvAttentionFlavours() {
  std::vector<std::string> names;
  for (const Flavour& flavour : Flavours()) names.emplace_back(flavour.name);
  return names;
}

void KvAttentionWith(std::string_view flavour, std::span<const KvQuery> queries, int64_t num_heads,
                     int64_t head_dim, float scale) {
  for (const Flavour& f : Flavours()) {
    if (flavour == f.name) return Attend(f, queries, num_heads, head_dim, scale);
  }
}

}  // namespace attnserve::core
