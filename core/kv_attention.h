#pragma once

// Attention of new query tokens over a sequence's cached keys and values, read in place from
// the cache's blocks (no contiguous copy): the memory-bound part of a decode step. Each query
// attends to the first `visible` cached tokens; the softmax runs online, block by block, so
// each key and value is read from memory once per tile of queries (below).

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/kv_cache.h"
#include "core/layer_spec.h"

namespace attnserve::core {

// One query token: its projected query (all heads, [num_heads * head_dim]), where its result
// goes (same width), and the keys it sees.
struct KvQuery {
  const float* q = nullptr;
  float* out = nullptr;
  const KvSequence* kv = nullptr;
  int64_t visible = 0;  // keys 0 .. visible - 1; none: the result is 0
};

// out = softmax(q K^T * scale) V per head, for every query, in parallel (OpenMP) over tiles:
// consecutive queries of one sequence (a prompt's chunk) share each block read from memory, and a
// tile takes as many of its heads together as its state on the stack allows (every head, up to a
// point), so that each cached block is read as one stream; fewer heads a task when there are too
// few tiles to share among the threads. head_dim <= kMaxDecodeHeadDim (Layer::Decode checks),
// and each query's cache has that head_dim.
// Runs on the widest kernel this CPU has (AVX512-BF16, AVX-512, AVX2 with FMA, portable), or the
// one ATTNSERVE_ATTENTION_KERNEL names (a name this CPU does not run: the widest; the one-shot
// attention tiles heed only "portable"). The AVX512-BF16 kernel multiplies a bf16 cache's keys and
// values by each query and softmax weight rounded to bf16 (sums in f32); every other kernel
// multiplies in f32 (a bf16 cache's values widened).
void KvAttention(std::span<const KvQuery> queries, int64_t num_heads, int64_t head_dim,
                 float scale);

// The kernel flavours this CPU runs, widest first ("avx512bf16", "avx512", "avx2", "portable"),
// and KvAttention on one of them (nothing for a name not listed): for tests and comparisons.
std::vector<std::string> KvAttentionFlavours();
void KvAttentionWith(std::string_view flavour, std::span<const KvQuery> queries, int64_t num_heads,
                     int64_t head_dim, float scale);

}  // namespace attnserve::core
