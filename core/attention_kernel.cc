#include "core/attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attnserve::core {
namespace {

// Number of keys query `i` of sequence `b` can see: a prefix of the keys, by construction.
int64_t VisibleKeys(const AttentionProblem& p, int64_t b, int64_t i) {
  const int64_t kv_len = p.kv_lengths[b];
  return p.causal ? std::min(kv_len, i + 1) : kv_len;
}

// One query row of one head: scores, max-subtracted softmax, weighted sum of values.
void RunRow(const AttentionProblem& p, int64_t b, int64_t h, int64_t i, std::vector<float>& s) {
  const int64_t d = p.head_dim;
  const int64_t visible = VisibleKeys(p, b, i);
  const float* q = p.q + (p.q_offsets[b] + i) * p.q_stride + h * d;
  float* out = p.out + (p.q_offsets[b] + i) * p.out_stride + h * d;
  std::fill(out, out + d, 0.0f);
  float* probs_row = nullptr;
  if (p.probs != nullptr) {
    probs_row = p.probs + ((b * p.num_heads + h) * p.probs_q_len + i) * p.probs_kv_len;
    std::fill(probs_row, probs_row + p.probs_kv_len, 0.0f);
  }
  if (visible <= 0) return;  // no visible key: the row attends to nothing
  s.resize(visible);
  float max_score = 0.0f;
  for (int64_t j = 0; j < visible; ++j) {
    const float* k = p.k + (p.kv_offsets[b] + j) * p.k_stride + h * d;
    float dot = 0.0f;
    for (int64_t c = 0; c < d; ++c) dot += q[c] * k[c];
    s[j] = dot * p.scale;
    max_score = j == 0 ? s[j] : std::max(max_score, s[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < visible; ++j) {
    s[j] = std::exp(s[j] - max_score);
    sum += s[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < visible; ++j) {
    const float w = s[j] * inv;
    if (probs_row != nullptr) probs_row[j] = w;
    const float* v = p.v + (p.kv_offsets[b] + j) * p.v_stride + h * d;
    for (int64_t c = 0; c < d; ++c) out[c] += w * v[c];
  }
}

// Zeroes the probability rows of padded queries, which no query row writes.
void ZeroPaddedProbRows(const AttentionProblem& p, int64_t b, int64_t h) {
  for (int64_t i = p.q_lengths[b]; i < p.probs_q_len; ++i) {
    float* row = p.probs + ((b * p.num_heads + h) * p.probs_q_len + i) * p.probs_kv_len;
    std::fill(row, row + p.probs_kv_len, 0.0f);
  }
}

}  // namespace

void RunAttention(const AttentionProblem& p) {
  const int64_t batch = static_cast<int64_t>(p.q_lengths.size());
  const int64_t pairs = batch * p.num_heads;
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic)
    for (int64_t bh = 0; bh < pairs; ++bh) {
      const int64_t b = bh / p.num_heads;
      const int64_t h = bh % p.num_heads;
      for (int64_t i = 0; i < p.q_lengths[b]; ++i) RunRow(p, b, h, i, scores);
      if (p.probs != nullptr) ZeroPaddedProbRows(p, b, h);
    }
  }
}

int64_t AttentionScratchBytes(const AttentionProblem& p) {
  int64_t max_kv = 0;
  for (int64_t len : p.kv_lengths) max_kv = std::max(max_kv, len);
  return max_kv * static_cast<int64_t>(sizeof(float));
}

}  // namespace attnserve::core
