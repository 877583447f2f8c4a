#pragma once

#include <cstdint>
#include <span>

namespace attnserve::core {

// The attention of a ragged batch after the projections: per sequence b and head h,
//   out[q rows of b, head h] = softmax(Q_bh K_bh^T * scale, masked) V_bh
// over the valid rows only. Q, K and V are packed (valid tokens back to back); head h owns
// columns [h*head_dim, (h+1)*head_dim) of each. Key j of sequence b is visible to query i when
// j < kv_lengths[b] and, if causal, j <= i. A query row with no visible key gets 0.
struct AttentionProblem {
  const float* q = nullptr;
  int64_t q_stride = 0;  // floats between consecutive rows of q
  const float* k = nullptr;
  int64_t k_stride = 0;
  const float* v = nullptr;
  int64_t v_stride = 0;
  float* out = nullptr;  // [sum(q_lengths), num_heads*head_dim] rows
  int64_t out_stride = 0;

  std::span<const int64_t> q_lengths;   // per sequence
  std::span<const int64_t> q_offsets;   // first row of sequence b in q and out
  std::span<const int64_t> kv_lengths;  // per sequence
  std::span<const int64_t> kv_offsets;  // first row of sequence b in k and v

  int64_t num_heads = 0;
  int64_t head_dim = 0;
  bool causal = false;
  float scale = 1.0f;  // 1/sqrt(head_dim)
  // Q K^T and P V may round their operands to bf16 (f32 accumulation, f32 softmax): twice the
  // arithmetic rate where the CPU has AVX512-BF16; elsewhere the f32 kernels run.
  bool bf16 = false;

  // When not null: the probabilities, [batch, num_heads, probs_q_len, probs_kv_len], every
  // masked or padded entry written 0. Only then is an [S, S_kv] block ever materialised.
  float* probs = nullptr;
  int64_t probs_q_len = 0;
  int64_t probs_kv_len = 0;
};

// Runs the attention of `problem`, parallel over sequences x heads x query blocks (OpenMP).
// Blocks that are fully masked (causal, beyond a length) cost nothing.
void RunAttention(const AttentionProblem& problem);

// Bytes of scratch RunAttention uses per thread for this problem (reported by the benchmark).
int64_t AttentionScratchBytes(const AttentionProblem& problem);

}  // namespace attnserve::core
