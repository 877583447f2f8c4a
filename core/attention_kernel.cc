// The flash-style attention driver: splits a ragged batch into tiles of up to kTileRows query
// rows of one (sequence, head), and runs each tile over its visible key blocks with an online
// softmax, so no [S, S_kv] matrix exists unless probabilities are asked for. The arithmetic is
// in the tile kernels (attention_tiles_*.cc).

#include "core/attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numbers>
#include <vector>

#include "core/attention_tiles.h"

namespace attnserve::core {
namespace internal {
namespace {

// One unit of parallel work: query rows [row0, row0 + rows) of sequence b, head h.
struct Tile {
  int64_t b;
  int64_t h;
  int64_t row0;
  int64_t rows;
  int64_t cost;  // rows x visible keys, for heaviest-first ordering
};

// Keys [0, end) that any row of the tile can see; blocks past it are never touched.
int64_t KeyEnd(const AttentionProblem& p, int64_t b, int64_t row0, int64_t rows) {
  const int64_t kv_len = p.kv_lengths[b];
  return p.causal ? std::min(kv_len, row0 + rows) : kv_len;
}

// Tiles grouped by (sequence, head) so that a group's K and V stay hot in cache while its
// tiles run; groups heaviest first and tiles heaviest first within a group, so the cheap
// work lands at the end and evens out the threads (ragged lengths, causal triangles).
std::vector<Tile> MakeTiles(const AttentionProblem& p) {
  struct Group {
    int64_t begin, end, cost;
  };
  std::vector<Tile> tiles;
  std::vector<Group> groups;
  const int64_t batch = static_cast<int64_t>(p.q_lengths.size());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      Group g{static_cast<int64_t>(tiles.size()), 0, 0};
      for (int64_t row0 = 0; row0 < p.q_lengths[b]; row0 += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, p.q_lengths[b] - row0);
        const int64_t cost = rows * (KeyEnd(p, b, row0, rows) + 1);
        tiles.push_back({b, h, row0, rows, cost});
        g.cost += cost;
      }
      g.end = static_cast<int64_t>(tiles.size());
      std::sort(tiles.begin() + g.begin, tiles.end(),
                [](const Tile& x, const Tile& y) { return x.cost > y.cost; });
      groups.push_back(g);
    }
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& x, const Group& y) { return x.cost > y.cost; });
  std::vector<Tile> ordered;
  ordered.reserve(tiles.size());
  for (const Group& g : groups) {
    ordered.insert(ordered.end(), tiles.begin() + g.begin, tiles.begin() + g.end);
  }
  return ordered;
}

// Per-thread buffers of one tile, 64-byte aligned for whole-vector loads.
class TileScratch {
 public:
  explicit TileScratch(int64_t head_dim)
      : floats_(static_cast<size_t>(FloatsFor(head_dim))),
        storage_(static_cast<float*>(std::aligned_alloc(64, floats_ * sizeof(float)))) {
    const size_t tile = static_cast<size_t>(head_dim) * kTileRows;
    q_t = storage_.get();
    out_t = q_t + tile;
    scores_t = out_t + tile;
    max = scores_t + kKeyBlock * kTileRows;
    sum = max + kTileRows;
    alpha = sum + kTileRows;
    inv_sum = alpha + kTileRows;
  }

  // Floats needed: Q^T and O^T tiles, one score block, four per-row vectors.
  static int64_t FloatsFor(int64_t head_dim) {
    return (2 * head_dim + kKeyBlock + 4) * kTileRows;
  }

  float* q_t;
  float* out_t;
  float* scores_t;
  float* max;
  float* sum;
  float* alpha;
  float* inv_sum;

 private:
  struct Free {
    void operator()(float* f) const { std::free(f); }
  };
  size_t floats_;
  std::unique_ptr<float, Free> storage_;
};

// Runs the online softmax over every visible key block; leaves O^T, max and sum.
void RunKeyBlocks(const AttentionProblem& p, const Tile& t, int vecs, const TileKernels& kernels,
                  TileScratch& s) {
  const int64_t d = p.head_dim;
  std::fill(s.out_t, s.out_t + d * kTileRows, 0.0f);
  std::fill(s.max, s.max + kTileRows, kNoKeyYet);
  std::fill(s.sum, s.sum + kTileRows, 0.0f);
  const int64_t key_end = KeyEnd(p, t.b, t.row0, t.rows);
  const float* k = p.k + p.kv_offsets[t.b] * p.k_stride + t.h * d;
  const float* v = p.v + p.kv_offsets[t.b] * p.v_stride + t.h * d;
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int num_keys = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - j0));
    const int64_t diag = j0 - t.row0;
    const NextBlock next{k + (j0 + kKeyBlock) * p.k_stride, p.k_stride,
                         v + (j0 + kKeyBlock) * p.v_stride, p.v_stride,
                         static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - j0 - num_keys))};
    kernels.score(s.q_t, vecs, static_cast<int>(d), k + j0 * p.k_stride, p.k_stride, num_keys,
                  next, s.scores_t);
    kernels.softmax(s.scores_t, vecs, num_keys, p.causal, diag, s.max, s.sum, s.alpha);
    kernels.accumulate(s.scores_t, vecs, num_keys, v + j0 * p.v_stride, p.v_stride,
                       static_cast<int>(d), s.alpha, s.out_t);
  }
  for (int r = 0; r < kTileRows; ++r) s.inv_sum[r] = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
}

// Recomputes the scores of the tile block by block with the final max and sum and writes the
// probabilities, every entry of the tile's rows included (masked and padded ones as 0).
void StoreProbs(const AttentionProblem& p, const Tile& t, int vecs, const TileKernels& kernels,
                TileScratch& s) {
  const int64_t d = p.head_dim;
  const int64_t key_end = KeyEnd(p, t.b, t.row0, t.rows);
  float* probs = p.probs + ((t.b * p.num_heads + t.h) * p.probs_q_len + t.row0) * p.probs_kv_len;
  const float* k = p.k + p.kv_offsets[t.b] * p.k_stride + t.h * d;
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int num_keys = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - j0));
    kernels.score(s.q_t, vecs, static_cast<int>(d), k + j0 * p.k_stride, p.k_stride, num_keys,
                  NextBlock{}, s.scores_t);
    kernels.normalize(s.scores_t, vecs, num_keys, p.causal, j0 - t.row0, s.max, s.inv_sum);
    for (int64_t r = 0; r < t.rows; ++r) {
      float* row = probs + r * p.probs_kv_len + j0;
      for (int j = 0; j < num_keys; ++j) row[j] = s.scores_t[j * kTileRows + r];
    }
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    float* row = probs + r * p.probs_kv_len;
    std::fill(row + key_end, row + p.probs_kv_len, 0.0f);
  }
}

// Zeroes the probability rows of padded queries, which belong to no tile.
void ZeroPaddedProbRows(const AttentionProblem& p, int64_t b, int64_t h) {
  const int64_t first = p.q_lengths[b];
  float* rows = p.probs + ((b * p.num_heads + h) * p.probs_q_len + first) * p.probs_kv_len;
  std::fill(rows, rows + (p.probs_q_len - first) * p.probs_kv_len, 0.0f);
}

void RunTile(const AttentionProblem& p, const Tile& t, const TileKernels& kernels,
             TileScratch& s) {
  const int vecs = static_cast<int>((t.rows + kLanes - 1) / kLanes);
  const int64_t d = p.head_dim;
  // Queries pre-multiplied by scale * log2(e): the kernels then work with base-2 exponentials.
  const float* q = p.q + (p.q_offsets[t.b] + t.row0) * p.q_stride + t.h * d;
  kernels.pack_queries(q, p.q_stride, static_cast<int>(t.rows), vecs, static_cast<int>(d),
                       p.scale * std::numbers::log2e_v<float>, s.q_t);
  RunKeyBlocks(p, t, vecs, kernels, s);
  // A row that saw no key has sum 0, inv_sum 0, and gets 0.
  float* out = p.out + (p.q_offsets[t.b] + t.row0) * p.out_stride + t.h * d;
  kernels.store_output(s.out_t, s.inv_sum, static_cast<int>(t.rows), static_cast<int>(d), out,
                       p.out_stride);
  if (p.probs != nullptr) StoreProbs(p, t, vecs, kernels, s);
}

}  // namespace

void RunAttentionWith(const AttentionProblem& p, const TileKernels& kernels) {
  const std::vector<Tile> tiles = MakeTiles(p);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int64_t pairs = static_cast<int64_t>(p.q_lengths.size()) * p.num_heads;
#pragma omp parallel
  {
    TileScratch scratch(p.head_dim);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < num_tiles; ++i) RunTile(p, tiles[i], kernels, scratch);
    if (p.probs != nullptr) {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < pairs; ++bh) ZeroPaddedProbRows(p, bh / p.num_heads, bh % p.num_heads);
    }
  }
}

}  // namespace internal

namespace {

// AVX-512 when the CPU has it, unless ATTNSERVE_ATTENTION_KERNEL=portable asks otherwise
// (to compare the two on one machine).
const internal::TileKernels& SelectedKernels() {
  static const internal::TileKernels& kernels = [] () -> const internal::TileKernels& {
    const char* forced = std::getenv("ATTNSERVE_ATTENTION_KERNEL");
    const internal::TileKernels* fast = internal::Avx512TileKernels();
    if (fast != nullptr && (forced == nullptr || std::strcmp(forced, "portable") != 0)) {
      return *fast;
    }
    return internal::PortableTileKernels();
  }();
  return kernels;
}

}  // namespace

void RunAttention(const AttentionProblem& problem) {
  internal::RunAttentionWith(problem, SelectedKernels());
}

int64_t AttentionScratchBytes(const AttentionProblem& problem) {
  return internal::TileScratch::FloatsFor(problem.head_dim) * static_cast<int64_t>(sizeof(float));
}

}  // namespace attnserve::core
