// Portable tile kernels: the reference flavour of attention_tiles.h, plain loops that any
// compiler vectorises for its baseline ISA. The AVX-512 flavour must agree with these.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/attention_tiles.h"

namespace attnserve::core::internal {
namespace {

void PackQueries(const float* q, int64_t q_stride, int rows, int vecs, int head_dim,
                 float factor, float* q_t) {
  for (int r = 0; r < vecs * kLanes; ++r) {
    for (int c = 0; c < head_dim; ++c) {
      q_t[c * kTileRows + r] = r < rows ? q[r * q_stride + c] * factor : 0.0f;
    }
  }
}

void Score(const float* q_t, int vecs, int head_dim, const float* k, int64_t k_stride,
           int num_keys, const NextBlock& /*next*/, float* scores_t) {
  const int rows = vecs * kLanes;
  for (int j = 0; j < num_keys; ++j) {
    float* s = scores_t + j * kTileRows;
    std::fill(s, s + rows, 0.0f);
    const float* key = k + j * k_stride;
    for (int c = 0; c < head_dim; ++c) {
      const float kc = key[c];
      const float* q = q_t + c * kTileRows;
      for (int r = 0; r < rows; ++r) s[r] += q[r] * kc;
    }
  }
}

// True when key j is visible to tile row r (see SoftmaxFn).
bool Visible(bool causal, int64_t diag, int j, int r) { return !causal || r >= diag + j; }

void Softmax(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag, float* max,
             float* sum, float* alpha) {
  const int rows = vecs * kLanes;
  for (int r = 0; r < rows; ++r) {
    float m = max[r];
    for (int j = 0; j < num_keys; ++j) {
      if (Visible(causal, diag, j, r)) m = std::max(m, scores_t[j * kTileRows + r]);
    }
    // Clamped so that kNoKeyYet - m underflows to 0 instead of reaching -inf.
    alpha[r] = std::exp2(std::max(max[r] - m, -120.0f));
    float block_sum = 0.0f;
    for (int j = 0; j < num_keys; ++j) {
      float& s = scores_t[j * kTileRows + r];
      s = Visible(causal, diag, j, r) ? std::exp2(s - m) : 0.0f;
      block_sum += s;
    }
    max[r] = m;
    sum[r] = sum[r] * alpha[r] + block_sum;
  }
}

void Accumulate(const float* p_t, int vecs, int num_keys, const float* v, int64_t v_stride,
                int head_dim, const float* alpha, float* out_t) {
  const int rows = vecs * kLanes;
  for (int c = 0; c < head_dim; ++c) {
    float* o = out_t + c * kTileRows;
    for (int r = 0; r < rows; ++r) o[r] *= alpha[r];
    for (int j = 0; j < num_keys; ++j) {
      const float vc = v[j * v_stride + c];
      const float* p = p_t + j * kTileRows;
      for (int r = 0; r < rows; ++r) o[r] += p[r] * vc;
    }
  }
}

void StoreOutput(const float* out_t, const float* inv_sum, int rows, int head_dim, float* out,
                 int64_t out_stride) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < head_dim; ++c) {
      out[r * out_stride + c] = out_t[c * kTileRows + r] * inv_sum[r];
    }
  }
}

void Normalize(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag,
               const float* max, const float* inv_sum) {
  const int rows = vecs * kLanes;
  for (int j = 0; j < num_keys; ++j) {
    float* s = scores_t + j * kTileRows;
    for (int r = 0; r < rows; ++r) {
      s[r] = Visible(causal, diag, j, r) ? std::exp2(s[r] - max[r]) * inv_sum[r] : 0.0f;
    }
  }
}

}  // namespace

const TileKernels& PortableTileKernels() {
  static constexpr TileKernels kKernels{"portable",  PackQueries, Score,      Softmax,
                                             Accumulate,  StoreOutput, Normalize};
  return kKernels;
}

}  // namespace attnserve::core::internal
