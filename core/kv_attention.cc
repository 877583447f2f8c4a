#include "core/kv_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

// One body, compiled three times: for AVX-512, for AVX2 + FMA (per-function target attributes,
// no global flags) and portable; the widest the CPU has is chosen once at run time, as the
// attention tiles are (attention_tiles_avx512.cc). The body works on 16-float vectors (GCC and
// clang vector extensions), which each flavour lowers to its own registers: one zmm, two ymm or
// four xmm.

namespace attnserve::core {
namespace {

static_assert(kKvBlockTokens == 16, "a block's 16 keys are one 16-float vector");

// How many blocks ahead a query's keys and values are asked for while it computes.
constexpr int64_t kPrefetchBlocks = 2;

typedef float Floats16 __attribute__((vector_size(64)));
typedef uint16_t Halves16 __attribute__((vector_size(32)));
typedef uint32_t Words16 __attribute__((vector_size(64)));

// 16 cached elements from `p` (unaligned), widened to f32 (bf16: the high half of an f32).
#define ATTNSERVE_LOAD16(out, p)                                              \
  do {                                                                        \
    if constexpr (sizeof(*(p)) == 2) {                                        \
      Halves16 halves_;                                                       \
      __builtin_memcpy(&halves_, (p), sizeof(halves_));                       \
      const Words16 words_ = __builtin_convertvector(halves_, Words16) << 16; \
      __builtin_memcpy(&(out), &words_, sizeof(out));                         \
    } else {                                                                  \
      __builtin_memcpy(&(out), (p), sizeof(out));                             \
    }                                                                         \
  } while (0)

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// x = e^x, elementwise, for -87 <= x <= 0 (scores less their maximum; below -87 it gives e^-87
// rather than 0, a weight of 1.6e-38 against the maximum's 1), within a few ulp of std::exp.
[[gnu::always_inline]] inline void Exp16(Floats16& x) {
  typedef int32_t Ints16 __attribute__((vector_size(64)));
  x = x < -87.0f ? Floats16{} - 87.0f : x;
  // e^x = 2^n * e^f with n = round(x / ln 2); f = x - n ln 2 in two parts (Cody and Waite), so
  // that the reduction adds no rounding error of its own. x - 0.5 ln 2 < 0: truncation rounds.
  const Ints16 n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, Ints16);
  const Floats16 nf = __builtin_convertvector(n, Floats16);
  const Floats16 f = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  // e^f for |f| <= ln(2) / 2, Taylor to f^7 (error below 2e-8 relative).
  Floats16 p = 1.0f / 5040 + f * (1.0f / 40320);
  p = 1.0f / 720 + f * p;
  p = 1.0f / 120 + f * p;
  p = 1.0f / 24 + f * p;
  p = 1.0f / 6 + f * p;
  p = 0.5f + f * p;
  p = 1.0f + f * p;
  p = 1.0f + f * p;
  const Ints16 scale_bits = (n + 127) << 23;  // 2^n, n >= -126
  Floats16 two_n;
  __builtin_memcpy(&two_n, &scale_bits, sizeof(two_n));
  x = p * two_n;
}

// One head's online softmax so far: the running maximum and sum, and the weighted values.
struct HeadState {
  float running_max;
  float running_sum;
  float* acc;  // [head_dim]
};

// One head of one query over one block's `rows` keys and values, T (float or bf16) storage,
// folded into `state`. The 16 scores side by side (keys are column-major in a head's part of a
// block: one vector FMA a dimension, in four independent chains), their exponentials as one
// vector, the online softmax's rescale once, then the values four 16-dimension slices at a
// time, the slices' accumulators held in registers across the block's rows.
template <typename T>
[[gnu::always_inline]] inline void AttendBlock(const float* q, const T* keys, int64_t rows,
                                               int64_t head_dim, float scale, HeadState& state) {
  const T* values = keys + head_dim * kKvBlockTokens;
  float* acc = state.acc;
  const int64_t slices = head_dim / 16 * 16;  // dimensions in whole 16-float slices
  Floats16 dots0 = {}, dots1 = {}, dots2 = {}, dots3 = {};
  int64_t d = 0;
  for (; d + 4 <= head_dim; d += 4) {
    Floats16 k0, k1, k2, k3;
    ATTNSERVE_LOAD16(k0, keys + d * kKvBlockTokens);
    ATTNSERVE_LOAD16(k1, keys + (d + 1) * kKvBlockTokens);
    ATTNSERVE_LOAD16(k2, keys + (d + 2) * kKvBlockTokens);
    ATTNSERVE_LOAD16(k3, keys + (d + 3) * kKvBlockTokens);
    dots0 += q[d] * k0;
    dots1 += q[d + 1] * k1;
    dots2 += q[d + 2] * k2;
    dots3 += q[d + 3] * k3;
  }
  for (; d < head_dim; ++d) {
    Floats16 k0;
    ATTNSERVE_LOAD16(k0, keys + d * kKvBlockTokens);
    dots0 += q[d] * k0;
  }
  Floats16 scores = ((dots0 + dots1) + (dots2 + dots3)) * scale;
  float block_max = state.running_max;
  for (int64_t r = 0; r < rows; ++r) block_max = std::max(block_max, scores[r]);
  // Rows past the visible ones hold whatever the block holds there: never used, but kept
  // finite for the exponential.
  for (int64_t r = rows; r < kKvBlockTokens; ++r) scores[r] = block_max;
  const float correction = std::exp(state.running_max - block_max);
  state.running_max = block_max;
  alignas(64) float weights[kKvBlockTokens];
  Floats16 exps = scores - block_max;
  Exp16(exps);
  __builtin_memcpy(weights, &exps, sizeof(weights));
  float block_sum = 0.0f;
  for (int64_t r = 0; r < rows; ++r) block_sum += weights[r];
  state.running_sum = state.running_sum * correction + block_sum;
  int64_t c = 0;
  for (; c + 64 <= slices; c += 64) {
    Floats16 a0, a1, a2, a3;
    __builtin_memcpy(&a0, acc + c, sizeof(a0));
    __builtin_memcpy(&a1, acc + c + 16, sizeof(a1));
    __builtin_memcpy(&a2, acc + c + 32, sizeof(a2));
    __builtin_memcpy(&a3, acc + c + 48, sizeof(a3));
    a0 *= correction;
    a1 *= correction;
    a2 *= correction;
    a3 *= correction;
    for (int64_t r = 0; r < rows; ++r) {
      const T* v = values + r * head_dim + c;
      Floats16 v0, v1, v2, v3;
      ATTNSERVE_LOAD16(v0, v);
      ATTNSERVE_LOAD16(v1, v + 16);
      ATTNSERVE_LOAD16(v2, v + 32);
      ATTNSERVE_LOAD16(v3, v + 48);
      a0 += weights[r] * v0;
      a1 += weights[r] * v1;
      a2 += weights[r] * v2;
      a3 += weights[r] * v3;
    }
    __builtin_memcpy(acc + c, &a0, sizeof(a0));
    __builtin_memcpy(acc + c + 16, &a1, sizeof(a1));
    __builtin_memcpy(acc + c + 32, &a2, sizeof(a2));
    __builtin_memcpy(acc + c + 48, &a3, sizeof(a3));
  }
  for (; c < slices; c += 16) {
    Floats16 a;
    __builtin_memcpy(&a, acc + c, sizeof(a));
    a *= correction;
    for (int64_t r = 0; r < rows; ++r) {
      Floats16 v;
      ATTNSERVE_LOAD16(v, values + r * head_dim + c);
      a += weights[r] * v;
    }
    __builtin_memcpy(acc + c, &a, sizeof(a));
  }
  for (; c < head_dim; ++c) {
    float a = acc[c] * correction;
    for (int64_t r = 0; r < rows; ++r) a += weights[r] * Widen(values[r * head_dim + c]);
    acc[c] = a;
  }
}

// The most dimensions a group of heads spans (its accumulators live on the stack).
constexpr int64_t kMaxGroupDims = 1024;

// One query's heads first_head .. first_head + heads - 1 (heads * head_dim <= kMaxGroupDims)
// over its visible keys, block by block: the group's parts of a block lie side by side, so
// each block is read as one stream, and the blocks ahead are asked for while it computes.
template <typename T>
[[gnu::always_inline]] inline void AttendGroupBody(const KvQuery& query, int64_t first_head,
                                                   int64_t heads, int64_t head_dim, float scale) {
  const KvSequence& kv = *query.kv;
  alignas(64) float acc[kMaxGroupDims];
  std::fill(acc, acc + heads * head_dim, 0.0f);
  HeadState states[kMaxGroupDims / 16];
  for (int64_t h = 0; h < heads; ++h) {
    states[h] = {-std::numeric_limits<float>::infinity(), 0.0f, acc + h * head_dim};
  }
  const int64_t group_bytes = heads * kv.head_bytes();
  for (int64_t start = 0; start < query.visible; start += kKvBlockTokens) {
    const int64_t block = start / kKvBlockTokens;
    const int64_t rows = std::min(kKvBlockTokens, query.visible - start);
    if (const int64_t ahead = block + kPrefetchBlocks; ahead * kKvBlockTokens < query.visible) {
      // Blocks are allocations of their own: no hardware prefetcher sees the next one coming.
      const char* next = static_cast<const char*>(kv.head(ahead, first_head));
      for (int64_t at = 0; at < group_bytes; at += 64) __builtin_prefetch(next + at);
    }
    const T* part = static_cast<const T*>(kv.head(block, first_head));
    for (int64_t h = 0; h < heads; ++h) {
      AttendBlock<T>(query.q + (first_head + h) * head_dim,
                     part + h * 2 * head_dim * kKvBlockTokens, rows, head_dim, scale, states[h]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inverse = query.visible > 0 ? 1.0f / states[h].running_sum : 0.0f;
    float* out = query.out + (first_head + h) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) out[d] = states[h].acc[d] * inverse;
  }
}

#undef ATTNSERVE_LOAD16

using AttendFn = void (*)(const KvQuery& query, int64_t first_head, int64_t heads, int64_t head_dim,
                          float scale);

template <typename T>
void AttendGroupPortable(const KvQuery& query, int64_t first_head, int64_t heads, int64_t head_dim,
                         float scale) {
  AttendGroupBody<T>(query, first_head, heads, head_dim, scale);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
template <typename T>
__attribute__((target("avx2,fma"))) void AttendGroupAvx2(const KvQuery& query, int64_t first_head,
                                                         int64_t heads, int64_t head_dim,
                                                         float scale) {
  AttendGroupBody<T>(query, first_head, heads, head_dim, scale);
}

template <typename T>
__attribute__((target("avx512f,avx2,fma"))) void AttendGroupAvx512(const KvQuery& query,
                                                                   int64_t first_head,
                                                                   int64_t heads, int64_t head_dim,
                                                                   float scale) {
  AttendGroupBody<T>(query, first_head, heads, head_dim, scale);
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
  if (__builtin_cpu_supports("avx512f")) {
    flavours.push_back({"avx512", &AttendGroupAvx512<float>, &AttendGroupAvx512<uint16_t>});
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    flavours.push_back({"avx2", &AttendGroupAvx2<float>, &AttendGroupAvx2<uint16_t>});
  }
#endif
  flavours.push_back({"portable", &AttendGroupPortable<float>, &AttendGroupPortable<uint16_t>});
  return flavours;
}

// The widest, unless ATTNSERVE_ATTENTION_KERNEL=portable asks for the portable one (as for the
// attention tiles: to compare on one machine).
const Flavour& Selected() {
  static const Flavour selected = [] {
    const char* forced = std::getenv("ATTNSERVE_ATTENTION_KERNEL");
    const std::vector<Flavour> flavours = Flavours();
    return forced != nullptr && std::strcmp(forced, "portable") == 0 ? flavours.back()
                                                                     : flavours.front();
  }();
  return selected;
}

void Attend(const Flavour& flavour, std::span<const KvQuery> queries, int64_t num_heads,
            int64_t head_dim, float scale) {
  int64_t reads = 0;  // keys read in all: a team is worth starting only for enough of them
  for (const KvQuery& query : queries) reads += query.visible;
  const bool parallel = reads * num_heads * head_dim > (1 << 16);
  // An item is one query's group of heads. Whole queries (every head, each block read as one
  // stream) when there are enough of them to share among the threads; else fewer heads an item.
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  const int64_t queries_n = static_cast<int64_t>(queries.size());
  int64_t group = std::min(num_heads, std::max<int64_t>(1, kMaxGroupDims / head_dim));
  while (group > 1 && queries_n * ((num_heads + group - 1) / group) < 4 * threads) group /= 2;
  const int64_t groups = (num_heads + group - 1) / group;
  const int64_t items = queries_n * groups;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t item = 0; item < items; ++item) {
    const KvQuery& query = queries[item / groups];
    const int64_t first = item % groups * group;
    (query.kv->precision() == KvPrecision::kBF16 ? flavour.bf16 : flavour.f32)(
        query, first, std::min(group, num_heads - first), head_dim, scale);
  }
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
