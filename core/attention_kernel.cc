// The flash-style attention driver. A ragged batch becomes tasks: runs of tiles (up to
// kTileRows query rows) of one (sequence, head), heaviest first, spread over the OpenMP team.
// A task packs its keys and values once; each tile then walks its visible key blocks with an
// online softmax, so no [S, S_kv] matrix exists unless probabilities are asked for, and causal
// blocks above the diagonal are never visited. The arithmetic is in the tile kernels
// (attention_tiles_*.cc).

#include "core/attention_kernel.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <numbers>
#include <vector>

#include "core/attention_tiles.h"
#include "core/dnnl_context.h"

namespace attnserve::core {
namespace internal {
namespace {

// Query rows [row0, row0 + rows) of sequence b, head h: one tile (rows <= kTileRows), or as a
// task, a run of consecutive tiles that share one packed copy of their keys and values.
struct Rows {
  int64_t b;
  int64_t h;
  int64_t row0;
  int64_t rows;
  int64_t cost = 0;  // rows x visible keys, for heaviest-first ordering
};

// Keys [0, end) that any of the rows can see; blocks past it are never touched.
int64_t KeyEnd(const AttentionProblem& p, const Rows& t) {
  const int64_t kv_len = p.kv_lengths[t.b];
  return p.causal ? std::min(kv_len, t.row0 + t.rows) : kv_len;
}

// Splits the work into tasks of whole tiles: one per (sequence, head) when there are plenty,
// else each (sequence, head) cut into a few runs of tiles so every thread has work. Heaviest
// first, so the cheap tasks land at the end and even out the threads (ragged, causal).
std::vector<Rows> MakeTasks(const AttentionProblem& p, int threads) {
  const int64_t batch = static_cast<int64_t>(p.q_lengths.size());
  int64_t groups = 0;
  for (int64_t b = 0; b < batch; ++b) groups += p.q_lengths[b] > 0 ? p.num_heads : 0;
  const int64_t min_tasks = 8 * static_cast<int64_t>(threads);
  const int64_t chunks = groups == 0 ? 1 : (min_tasks + groups - 1) / groups;
  std::vector<Rows> tasks;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t tiles = (p.q_lengths[b] + kTileRows - 1) / kTileRows;
    const int64_t per_task = std::max<int64_t>(1, (tiles + chunks - 1) / chunks) * kTileRows;
    for (int64_t h = 0; h < p.num_heads; ++h) {
      for (int64_t row0 = 0; row0 < p.q_lengths[b]; row0 += per_task) {
        Rows t{b, h, row0, std::min(per_task, p.q_lengths[b] - row0)};
        t.cost = t.rows * (KeyEnd(p, t) + 1);
        tasks.push_back(t);
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Rows& x, const Rows& y) { return x.cost > y.cost; });
  return tasks;
}

// Floats of per-thread scratch: Q^T and O^T tiles, one score block, four per-row vectors, and
// room to pack pack_rows keys and values of head_dim each.
int64_t ScratchFloats(int64_t head_dim, int64_t pack_rows) {
  return (2 * head_dim + kKeyBlock + 4) * kTileRows + 2 * pack_rows * head_dim;
}

// Scratch of every thread of the team, owned by the calling thread and kept across its calls
// (steady-state calls neither allocate nor fault in pages). Allocated before the parallel
// region, so that running out of memory throws std::bad_alloc to the caller instead of
// terminating inside OpenMP; per calling thread, so concurrent callers never share it.
float* TeamStorage(int64_t floats) {
  thread_local ScratchBuffer storage;
  return storage.As<float>(floats);
}

// Per-thread scratch rounded to whole cache lines, so every thread's slice stays aligned.
int64_t SliceFloats(int64_t head_dim, int64_t pack_rows) {
  return (ScratchFloats(head_dim, pack_rows) + 15) / 16 * 16;
}

// One thread's buffers, carved out of its slice of TeamStorage, 64-byte aligned.
struct TileScratch {
  TileScratch(float* slice, int64_t head_dim, int64_t pack_rows) : pack_rows(pack_rows) {
    const int64_t tile = head_dim * kTileRows;
    q_t = slice;
    out_t = q_t + tile;
    scores_t = out_t + tile;
    max = scores_t + kKeyBlock * kTileRows;
    sum = max + kTileRows;
    alpha = sum + kTileRows;
    inv_sum = alpha + kTileRows;
    k = inv_sum + kTileRows;
    v = k + pack_rows * head_dim;
  }

  float* q_t;
  float* out_t;
  float* scores_t;
  float* max;
  float* sum;
  float* alpha;
  float* inv_sum;
  int64_t pack_rows;  // keys (and values) that fit in k and v
  float* k;           // packed keys of the current task, head_dim floats a row
  float* v;           // packed values
};

// Copies the first key_end keys and values of (b, h) into the scratch, rows back to back. In
// fused QKV layouts rows are a page or more apart: every tile reading them there would pay a
// TLB miss per row and per tile; packed, a task pays it once per row.
void PackKeysValues(const AttentionProblem& p, const Rows& t, int64_t key_end, TileScratch& s) {
  const int64_t d = p.head_dim;
  const float* k = p.k + p.kv_offsets[t.b] * p.k_stride + t.h * d;
  const float* v = p.v + p.kv_offsets[t.b] * p.v_stride + t.h * d;
  constexpr int64_t kAhead = 8;  // rows requested ahead of the copy
  for (int64_t j = 0; j < key_end; ++j) {
    if (j + kAhead < key_end) {
      __builtin_prefetch(k + (j + kAhead) * p.k_stride);
      __builtin_prefetch(v + (j + kAhead) * p.v_stride);
    }
    std::memcpy(s.k + j * d, k + j * p.k_stride, d * sizeof(float));
    std::memcpy(s.v + j * d, v + j * p.v_stride, d * sizeof(float));
  }
}

// Key `j` of keys or values laid out `stride` elements of `element_bytes` apart.
const void* KeyAt(const void* base, int64_t j, int64_t stride, int element_bytes) {
  return static_cast<const char*>(base) + j * stride * element_bytes;
}

// The key block after j0 as a prefetch hint; none for a kernel's own packed (contiguous) form.
NextBlock NextBlockHint(const KeysValues& kv, const TileKernels& kernels, int64_t j1,
                        int64_t key_end) {
  if (kernels.pack_keys_values != nullptr || j1 >= key_end) return NextBlock{};
  return NextBlock{static_cast<const float*>(kv.k) + j1 * kv.k_stride, kv.k_stride,
                   static_cast<const float*>(kv.v) + j1 * kv.v_stride, kv.v_stride,
                   static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - j1))};
}

// Runs the online softmax over every visible key block of the keys and values; leaves O^T,
// max and sum.
void RunKeyBlocks(const AttentionProblem& p, const Rows& t, int vecs, const KeysValues& kv,
                  const TileKernels& kernels, TileScratch& s) {
  const int64_t d = p.head_dim;
  const int bytes = kernels.kv_element_bytes;
  std::fill(s.out_t, s.out_t + d * kTileRows, 0.0f);
  std::fill(s.max, s.max + kTileRows, kNoKeyYet);
  std::fill(s.sum, s.sum + kTileRows, 0.0f);
  const int64_t key_end = KeyEnd(p, t);
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int num_keys = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - j0));
    const int64_t diag = j0 - t.row0;
    kernels.score(s.q_t, vecs, static_cast<int>(d), KeyAt(kv.k, j0, kv.k_stride, bytes),
                  kv.k_stride, num_keys, NextBlockHint(kv, kernels, j0 + kKeyBlock, key_end),
                  s.scores_t);
    kernels.softmax(s.scores_t, vecs, num_keys, p.causal, diag, s.max, s.sum, s.alpha);
    kernels.accumulate(s.scores_t, vecs, num_keys, KeyAt(kv.v, j0, kv.v_stride, bytes), kv.v_stride,
                       static_cast<int>(d), s.alpha, s.out_t);
  }
  // A row that saw keys and whose maximum never rose above kNoKeyYet saw only scores that
  // overflowed float32 to -inf (or lie within a hair of it, -3e38): its weights mean nothing,
  // and a NaN makes the output's finiteness check refuse the call. A row that saw no key has
  // sum 0 and gets 0.
  for (int r = 0; r < kTileRows; ++r) {
    s.inv_sum[r] = key_end > 0 && !(s.max[r] > kNoKeyYet)
                       ? std::numeric_limits<float>::quiet_NaN()
                       : (s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f);
  }
}

// Recomputes the scores of the tile block by block with the final max and sum and writes the
// probabilities, every entry of the tile's rows included (masked and padded ones as 0).
void StoreProbs(const AttentionProblem& p, const Rows& t, int vecs, const KeysValues& kv,
                const TileKernels& kernels, TileScratch& s) {
  const int64_t d = p.head_dim;
  const int64_t key_end = KeyEnd(p, t);
  float* probs = p.probs + ((t.b * p.num_heads + t.h) * p.probs_q_len + t.row0) * p.probs_kv_len;
  for (int64_t j0 = 0; j0 < key_end; j0 += kKeyBlock) {
    const int num_keys = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - j0));
    kernels.score(s.q_t, vecs, static_cast<int>(d),
                  KeyAt(kv.k, j0, kv.k_stride, kernels.kv_element_bytes), kv.k_stride, num_keys,
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
  const int64_t first = std::min(p.q_lengths[b], p.probs_q_len);
  float* rows = p.probs + ((b * p.num_heads + h) * p.probs_q_len + first) * p.probs_kv_len;
  std::fill(rows, rows + (p.probs_q_len - first) * p.probs_kv_len, 0.0f);
}

void RunTile(const AttentionProblem& p, const Rows& t, const KeysValues& kv,
             const TileKernels& kernels, TileScratch& s) {
  const int vecs = static_cast<int>((t.rows + kLanes - 1) / kLanes);
  const int64_t d = p.head_dim;
  // Queries pre-multiplied by scale * log2(e): the kernels then work with base-2 exponentials.
  const float* q = p.q + (p.q_offsets[t.b] + t.row0) * p.q_stride + t.h * d;
  kernels.pack_queries(q, p.q_stride, static_cast<int>(t.rows), vecs, static_cast<int>(d),
                       p.scale * std::numbers::log2e_v<float>, s.q_t);
  RunKeyBlocks(p, t, vecs, kv, kernels, s);
  float* out = p.out + (p.q_offsets[t.b] + t.row0) * p.out_stride + t.h * d;
  kernels.store_output(s.out_t, s.inv_sum, static_cast<int>(t.rows), static_cast<int>(d), out,
                       p.out_stride);
  if (p.probs != nullptr) StoreProbs(p, t, vecs, kv, kernels, s);
}

// Runs a task's tiles. Kernels with a form of their own convert the keys and values once per
// task. For the f32 kernels, several tiles share one packed copy; a lone tile reads them in
// place, since packing would read every row once as well.
void RunTask(const AttentionProblem& p, const Rows& task, const TileKernels& kernels,
             TileScratch& s) {
  const int64_t d = p.head_dim;
  const float* k = p.k + p.kv_offsets[task.b] * p.k_stride + task.h * d;
  const float* v = p.v + p.kv_offsets[task.b] * p.v_stride + task.h * d;
  KeysValues kv{k, p.k_stride, v, p.v_stride};
  const int64_t key_end = KeyEnd(p, task);
  const bool fits = key_end <= s.pack_rows;
  const TileKernels* run = &kernels;
  if (kernels.pack_keys_values != nullptr && fits) {
    kv = kernels.pack_keys_values(k, p.k_stride, v, p.v_stride, key_end, static_cast<int>(d), s.k,
                                  s.v);
  } else {
    if (kernels.pack_keys_values != nullptr) run = kernels.unpacked_fallback;
    if (task.rows > kTileRows && fits) {
      PackKeysValues(p, task, key_end, s);
      kv = KeysValues{s.k, d, s.v, d};
    }
  }
  for (int64_t row0 = task.row0; row0 < task.row0 + task.rows; row0 += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, task.row0 + task.rows - row0);
    RunTile(p, Rows{task.b, task.h, row0, rows}, kv, *run, s);
  }
}

// Keys (and values) each thread may pack: the longest key sequence, unless the team's packed
// copies would then pass kPackBudgetBytes (long sequences on many threads); tasks with more
// visible keys than that read them in place.
int64_t PackRows(const AttentionProblem& p, int threads) {
  constexpr int64_t kPackBudgetBytes = int64_t{256} << 20;
  int64_t max_kv = 0;
  for (int64_t len : p.kv_lengths) max_kv = std::max(max_kv, len);
  const int64_t row_bytes = 2 * std::max<int64_t>(p.head_dim, 1) * sizeof(float);
  return std::min(max_kv, kPackBudgetBytes / (row_bytes * std::max(threads, 1)));
}

}  // namespace

void RunAttentionWith(const AttentionProblem& p, const TileKernels& kernels,
                      int64_t max_pack_rows) {
  const std::vector<Rows> tasks = MakeTasks(p, omp_get_max_threads());
  if (tasks.empty() && p.probs == nullptr) return;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t pairs = static_cast<int64_t>(p.q_lengths.size()) * p.num_heads;
  // Below about 30 microseconds of work, waking the other threads costs more than it saves
  // (and on a loaded machine a woken thread may be descheduled holding a task).
  constexpr int64_t kParallelMinFlops = int64_t{4} << 20;
  int64_t flops = 0;
  for (const Rows& t : tasks) flops += 4 * t.cost * p.head_dim;
  const int threads = flops < kParallelMinFlops ? 1 : omp_get_max_threads();
  const int64_t pack_rows = std::min(PackRows(p, threads), max_pack_rows);
  const int64_t slice = SliceFloats(p.head_dim, pack_rows);
  float* storage = TeamStorage(slice * threads);
  // Each thread's share (worksharing loops, orphaned: they bind to the team that runs this).
  auto work = [&] {
    TileScratch scratch(storage + omp_get_thread_num() * slice, p.head_dim, pack_rows);
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < num_tasks; ++i) RunTask(p, tasks[i], kernels, scratch);
    if (p.probs != nullptr) {
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < pairs; ++bh) {
        ZeroPaddedProbRows(p, bh / p.num_heads, bh % p.num_heads);
      }
    }
  };
  if (threads == 1) {
    // No region: ending one costs a futex call even on a team of one (parallel_for.h).
    work();
    return;
  }
#pragma omp parallel num_threads(threads)
  work();
}

}  // namespace internal

namespace {

// AVX-512 when the CPU has it (with bf16 products when asked for and AVX512-BF16 is there),
// unless ATTNSERVE_ATTENTION_KERNEL=portable asks otherwise (to compare on one machine).
const internal::TileKernels& SelectedKernels(bool bf16) {
  static const bool portable = [] {
    const char* forced = std::getenv("ATTNSERVE_ATTENTION_KERNEL");
    return forced != nullptr && std::strcmp(forced, "portable") == 0;
  }();
  static const internal::TileKernels* const f32 =
      portable ? nullptr : internal::Avx512TileKernels();
  static const internal::TileKernels* const with_bf16 =
      portable ? nullptr : internal::Avx512Bf16TileKernels();
  if (bf16 && with_bf16 != nullptr) return *with_bf16;
  return f32 != nullptr ? *f32 : internal::PortableTileKernels();
}

}  // namespace

void RunAttention(const AttentionProblem& problem) {
  internal::RunAttentionWith(problem, SelectedKernels(problem.bf16));
}

int64_t AttentionScratchBytes(const AttentionProblem& problem) {
  const int64_t pack_rows = internal::PackRows(problem, omp_get_max_threads());
  return internal::SliceFloats(problem.head_dim, pack_rows) * static_cast<int64_t>(sizeof(float));
}

}  // namespace attnserve::core
