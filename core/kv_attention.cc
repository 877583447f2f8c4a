#include "core/kv_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace attnserve::core {
namespace {

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// One query's one head over its visible keys, blocks of T (float or bf16 storage).
template <typename T>
void AttendHead(const KvQuery& query, int64_t head, int64_t head_dim, float scale) {
  const KvSequence& kv = *query.kv;
  const int64_t width = kv.width();
  const float* q = query.q + head * head_dim;
  float* out = query.out + head * head_dim;
  float acc[512];  // head_dim <= 512 (checked by Layer::Decode)
  std::fill(acc, acc + head_dim, 0.0f);
  float running_max = -std::numeric_limits<float>::infinity();
  float running_sum = 0.0f;
  float scores[kKvBlockTokens];
  for (int64_t start = 0; start < query.visible; start += kKvBlockTokens) {
    const int64_t block = start / kKvBlockTokens;
    const int64_t rows = std::min(kKvBlockTokens, query.visible - start);
    // Keys column-major: the block's scores accumulate side by side, one vector FMA a column.
    const T* keys = static_cast<const T*>(kv.keys(block)) + head * head_dim * kKvBlockTokens;
    const T* values = static_cast<const T*>(kv.values(block)) + head * head_dim;
    float dots[kKvBlockTokens] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const float qd = q[d];
      const T* column = keys + d * kKvBlockTokens;
#pragma omp simd
      for (int64_t r = 0; r < kKvBlockTokens; ++r) dots[r] += qd * Widen(column[r]);
    }
    float block_max = running_max;
    for (int64_t r = 0; r < rows; ++r) {  // rows past the visible ones are never used
      scores[r] = dots[r] * scale;
      block_max = std::max(block_max, scores[r]);
    }
    // Rescale what was summed under the old maximum once per block, not once per key.
    const float correction = std::exp(running_max - block_max);
    running_sum *= correction;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
    running_max = block_max;
    for (int64_t r = 0; r < rows; ++r) {
      const float p = std::exp(scores[r] - running_max);
      running_sum += p;
      const T* v = values + r * width;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += p * Widen(v[d]);
    }
  }
  const float inverse = query.visible > 0 ? 1.0f / running_sum : 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) out[d] = acc[d] * inverse;
}

}  // namespace

void KvAttention(std::span<const KvQuery> queries, int64_t num_heads, int64_t head_dim,
                 float scale) {
  const int64_t items = static_cast<int64_t>(queries.size()) * num_heads;
  int64_t reads = 0;  // keys read in all: a team is worth starting only for enough of them
  for (const KvQuery& query : queries) reads += query.visible;
#pragma omp parallel for schedule(dynamic, 4) if (reads * num_heads * head_dim > (1 << 16))
  for (int64_t item = 0; item < items; ++item) {
    const KvQuery& query = queries[item / num_heads];
    const int64_t head = item % num_heads;
    if (query.kv->precision() == KvPrecision::kBF16) {
      AttendHead<uint16_t>(query, head, head_dim, scale);
    } else {
      AttendHead<float>(query, head, head_dim, scale);
    }
  }
}

}  // namespace attnserve::core
