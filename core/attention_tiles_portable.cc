// Portable tile kernels: the reference flavour of attention_tiles.h, plain loops that any
// compiler vectorises for its baseline ISA. The AVX-512 flavour must agree with these.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/attention_tiles.h"

// On x86-64, GCC also compiles each kernel for AVX2 + FMA and picks the clone at load time
// (CPUs without AVX-512, such as AMD Zen 3, then get 256-bit vectors instead of SSE2).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ATTNSERVE_CLONES __attribute__((target_clones("avx2,fma", "default")))
#else
#define ATTNSERVE_CLONES
#endif

namespace attnserve::core::internal {
namespace {

ATTNSERVE_CLONES void PackQueries(const float* q, int64_t q_stride, int rows, int vecs,
                                  int head_dim, float factor, float* q_t) {
  for (int r = 0; r < vecs * kLanes; ++r) {
    for (int c = 0; c < head_dim; ++c) {
      q_t[c * kTileRows + r] = r < rows ? q[r * q_stride + c] * factor : 0.0f;
    }
  }
}

// Register blocking the compiler can see through: 4 keys x 16 rows of accumulators in a local
// array with constant bounds, which it keeps in vector registers.
constexpr int kKeysAtOnce = 4;

ATTNSERVE_CLONES void Score(const float* q_t, int vecs, int head_dim, const void* k_rows,
                            int64_t k_stride, int num_keys, const NextBlock& /*next*/,
                            float* scores_t) {
  const float* k = static_cast<const float*>(k_rows);
  for (int j0 = 0; j0 < num_keys; j0 += kKeysAtOnce) {
    const float* keys[kKeysAtOnce];  // past the end: the last key again, result unused
    for (int j = 0; j < kKeysAtOnce; ++j) keys[j] = k + std::min(j0 + j, num_keys - 1) * k_stride;
    for (int r0 = 0; r0 < vecs * kLanes; r0 += kLanes) {
      float acc[kKeysAtOnce][kLanes] = {};
      for (int c = 0; c < head_dim; ++c) {
        const float* q = q_t + c * kTileRows + r0;
        for (int j = 0; j < kKeysAtOnce; ++j) {
          for (int r = 0; r < kLanes; ++r) acc[j][r] += q[r] * keys[j][c];
        }
      }
      for (int j = 0; j < kKeysAtOnce && j0 + j < num_keys; ++j) {
        std::copy(acc[j], acc[j] + kLanes, scores_t + (j0 + j) * kTileRows + r0);
      }
    }
  }
}

// True when key j is visible to tile row r (see SoftmaxFn).
bool Visible(bool causal, int64_t diag, int j, int r) { return !causal || r >= diag + j; }

ATTNSERVE_CLONES void Softmax(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag,
                              float* max, float* sum, float* alpha) {
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

// Column by column: the rows of one output column stay in L1 across the block's keys.
ATTNSERVE_CLONES void Accumulate(const float* p_t, int vecs, int num_keys, const void* v_rows,
                                 int64_t v_stride, int head_dim, const float* alpha, float* out_t) {
  const float* v = static_cast<const float*>(v_rows);
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

ATTNSERVE_CLONES void StoreOutput(const float* out_t, const float* inv_sum, int rows, int head_dim,
                                  float* out, int64_t out_stride) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < head_dim; ++c) {
      out[r * out_stride + c] = out_t[c * kTileRows + r] * inv_sum[r];
    }
  }
}

ATTNSERVE_CLONES void Normalize(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag,
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
  static constexpr TileKernels kKernels{PackQueries, Score,       Softmax,
                                        Accumulate,  StoreOutput, Normalize};
  return kKernels;
}

}  // namespace attnserve::core::internal
