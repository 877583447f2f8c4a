#pragma once

// Internal to the attention kernel: the tile layout and the three tile operations the
// flash-style driver (attention_kernel.cc) is built from, in a portable and an AVX-512 flavour.
//
// A tile is up to kTileRows query rows of one (sequence, head), stored transposed: row r of the
// tile is lane r % kLanes of vector r / kLanes, so the per-row softmax state is a few vectors
// and every reduction over keys is vertical (no horizontal shuffles in the hot loop).
//
// Keys and values reach the score and accumulate kernels as `const void*` with a stride in
// elements per key: f32 rows of the projections (or a packed f32 copy) for the f32 kernels, the
// kernel's own packed form for kernels that have a PackKeysValuesFn (bf16).

#include <cstdint>
#include <limits>

#include "core/attention_kernel.h"

namespace attnserve::core::internal {

// Floats in one vector: a zmm register holds the same key's scores for 16 query rows.
inline constexpr int kLanes = 16;
// Query rows per tile (three vectors): 8 keys x 3 vectors fill 24 of 32 zmm registers.
inline constexpr int kMaxTileVecs = 3;
inline constexpr int kTileRows = kMaxTileVecs * kLanes;
// Keys per online-softmax step: large enough that rescaling the accumulator is cheap.
inline constexpr int kKeyBlock = 64;
// Keys per register tile of the score kernel; the driver pads key counts up to it.
inline constexpr int kKeyTile = 8;

// q_t[c * kTileRows + r] = q[r * q_stride + c] * factor for r < rows, 0 for the rows up to
// vecs * kLanes: the tile's queries, transposed.
using PackQueriesFn = void (*)(const float* q, int64_t q_stride, int rows, int vecs, int head_dim,
                               float factor, float* q_t);

// The rows of a key block that the next block will read, so that the score kernel can ask for
// them while it computes (rows of fused QKV are a page apart: the hardware prefetcher, which
// stays within a page, cannot see them coming). A hint only: count 0 means none.
struct NextBlock {
  const float* k = nullptr;
  int64_t k_stride = 0;
  const float* v = nullptr;
  int64_t v_stride = 0;
  int count = 0;
};

// scores_t[j * kTileRows + r] = sum_c q_t[c * kTileRows + r] * k[j * k_stride + c] for
// j < num_keys rounded up to kKeyTile (extra keys repeat key num_keys - 1; callers ignore
// them) and r < vecs * kLanes.
using ScoreFn = void (*)(const float* q_t, int vecs, int head_dim, const void* k, int64_t k_stride,
                         int num_keys, const NextBlock& next, float* scores_t);

// The online-softmax step over one key block of base-2 log scores, in place:
// for each row r, max_new = max(max[r], visible scores), alpha[r] = 2^(max[r] - max_new),
// scores -> 2^(score - max_new) (0 where masked), sum[r] = sum[r] * alpha[r] + sum of them.
// Key j is masked from row r when causal and r < diag + j. max starts at kNoKeyYet.
using SoftmaxFn = void (*)(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag,
                           float* max, float* sum, float* alpha);

// out_t[c * tile_stride + r] = out_t[...] * alpha[r] + sum_j p_t[j][r] * v[j * v_stride + c].
using AccumulateFn = void (*)(const float* p_t, int vecs, int num_keys, const void* v,
                              int64_t v_stride, int head_dim, const float* alpha, float* out_t);

// Keys and values of one (sequence, head) in the form a kernel's score and accumulate read.
struct KeysValues {
  const void* k = nullptr;
  int64_t k_stride = 0;  // elements of the kernel's format per key
  const void* v = nullptr;
  int64_t v_stride = 0;
};

// Converts keys and values [0, count) (f32 rows) into the kernel's own form in k_out and v_out,
// each with room for count * head_dim floats. For kernels that cannot read f32 rows.
using PackKeysValuesFn = KeysValues (*)(const float* k, int64_t k_stride, const float* v,
                                        int64_t v_stride, int64_t count, int head_dim, void* k_out,
                                        void* v_out);

// Turns the scores of one key block into probabilities: 2^(score - max[r]) * inv_sum[r], 0
// where masked (as in SoftmaxFn). Used only when probabilities are asked for.
using NormalizeFn = void (*)(float* scores_t, int vecs, int num_keys, bool causal, int64_t diag,
                             const float* max, const float* inv_sum);

// out[r * out_stride + c] = out_t[c * kTileRows + r] * inv_sum[r] for r < rows.
using StoreOutputFn = void (*)(const float* out_t, const float* inv_sum, int rows, int head_dim,
                               float* out, int64_t out_stride);

// Running max of a row that has not seen a visible key: finite, so no inf - inf anywhere.
inline constexpr float kNoKeyYet = -3.0e38f;

// One implementation of the tile operations.
struct TileKernels {
  PackQueriesFn pack_queries;
  ScoreFn score;
  SoftmaxFn softmax;
  AccumulateFn accumulate;
  StoreOutputFn store_output;
  NormalizeFn normalize;
  // Null: score and accumulate read f32 rows (kv_element_bytes 4), in place or packed by the
  // driver. Set: every task converts its keys and values with it first.
  PackKeysValuesFn pack_keys_values = nullptr;
  int kv_element_bytes = 4;
  // For a kernel with its own packing: what runs a task whose keys do not fit the scratch.
  const TileKernels* unpacked_fallback = nullptr;
};

// Plain C++ kernels: run on any CPU, used when AVX-512 is absent.
const TileKernels& PortableTileKernels();

// AVX-512 kernels, or nullptr when this CPU lacks AVX-512F.
const TileKernels* Avx512TileKernels();

// AVX-512 kernels whose two products (Q K^T, P V) take bf16 operands with f32 accumulation
// (vdpbf16ps); the softmax stays f32. Or nullptr when this CPU lacks AVX512-BF16.
const TileKernels* Avx512Bf16TileKernels();

// RunAttention with the given kernels; lets tests compare both flavours on one machine, and
// lower the number of keys a thread may pack to reach the path of tasks whose keys do not fit.
void RunAttentionWith(const AttentionProblem& problem, const TileKernels& kernels,
                      int64_t max_pack_rows = std::numeric_limits<int64_t>::max());

}  // namespace attnserve::core::internal
