#pragma once

// The keys and values a decode session keeps (its KV cache): fixed-size blocks of
// kKvBlockTokens tokens, taken from one pool per process as the sequence grows and charged to
// one byte budget, so a session's memory follows its length, not a maximum. A decode step reads
// every cached key and value once, in place, block by block (Layer::Decode).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/kv_block_pool.h"

namespace attnserve::core {

// Tokens per block (vLLM's default): small enough that a sequence wastes little of its last
// block, large enough that a block's rows stream from memory.
inline constexpr int64_t kKvBlockTokens = 16;

// The bytes every cache of the process may hold together (--kv-cache-mib), and the pool their
// blocks come from (kv_block_pool.h). Thread safe.
class KvCacheBudget {
 public:
  explicit KvCacheBudget(int64_t limit_bytes) : limit_(limit_bytes), pool_(limit_bytes) {}

  // Takes `bytes` from the budget; false (and nothing taken) when they do not fit.
  bool TryCharge(int64_t bytes);
  void Release(int64_t bytes) { used_.fetch_sub(bytes); }

  int64_t used() const { return used_.load(); }
  int64_t limit() const { return limit_; }

  KvBlockPool& pool() { return pool_; }
  const KvBlockPool& pool() const { return pool_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
  KvBlockPool pool_;
};

// The refusal of `more` bytes the budget cannot take for `what` ("this step"), saying what
// sessions hold and the limit.
absl::Status KvCacheFull(const KvCacheBudget& budget, int64_t more,
                         absl::string_view what = "this step");

// How a cache stores its rows: float32, or bfloat16 (half the bytes a step reads).
enum class KvPrecision { kF32, kBF16 };

// One sequence's cached keys and values: rows of `width` (the layer's inner width, all heads of
// `head_dim` dimensions), K and V each, in blocks. Not thread safe: its session uses it one step
// at a time.
class KvSequence {
 public:
  // Charges its blocks to `budget`, which outlives it; `bytes_counter` (may be null) follows
  // the bytes it holds, e.g. a model's attnserve_kv_cache_bytes. `head_dim` divides `width`.
  KvSequence(int64_t width, int64_t head_dim, KvPrecision precision, KvCacheBudget* budget,
             std::atomic<int64_t>* bytes_counter = nullptr);
  ~KvSequence();
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  // Tokens cached.
  int64_t length() const { return length_; }
  int64_t width() const { return width_; }
  int64_t head_dim() const { return head_dim_; }
  KvPrecision precision() const { return precision_; }
  // Bytes its blocks hold.
  int64_t bytes() const;

  // Makes room for `length` tokens, allocating blocks; ResourceExhausted naming the budget
  // (or saying why its pool could not give them) when they do not fit, and then nothing
  // changes.
  absl::Status Reserve(int64_t length);
  // The bytes Reserve(length) would take (0 when the room is there); length >= 0.
  int64_t BytesToReserve(int64_t length) const;

  // Stores the key and value rows of the token at `position` (< the reserved room), and makes
  // the length at least position + 1.
  void Write(int64_t position, const float* key, const float* value);

  // Drops the tokens at `length` and after, freeing the blocks no longer needed.
  void Truncate(int64_t length);

  // Drops the tokens at `length` and after but keeps every block (a step about to append
  // reuses them); Shrink frees what the length then does not need.
  void Rewind(int64_t length) { length_ = std::min(length_, std::max<int64_t>(length, 0)); }
  void Shrink();

  // Blocks held.
  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // Head `h`'s part of block `b`: its keys, then its values. f32: the keys column-major
  // ([head_dim][kKvBlockTokens]: the block's tokens side by side in each column, so one query's
  // scores against a block are vector operations), the values row-major ([kKvBlockTokens]
  // [head_dim]). bf16: the same with pairs side by side, so that 64 bytes widen to two 16-float
  // vectors with a shift and a mask: the keys in dimension pairs ([head_dim / 2][kKvBlockTokens]
  // [2], an odd last dimension padded), the values in row pairs ([kKvBlockTokens / 2][head_dim]
  // [2]). One head's part is contiguous (a step reads it as one stream), and starts on a cache
  // line.
  const void* head(int64_t b, int64_t h) const { return blocks_[b] + h * head_bytes(); }
  // Bytes of one head's part of a block (keys and values).
  int64_t head_bytes() const;

  // Bytes one block takes.
  int64_t block_bytes() const;

 private:
  void FreeBlocksFrom(size_t first);

  const int64_t width_;
  const int64_t head_dim_;
  const KvPrecision precision_;
  KvCacheBudget* const budget_;
  std::atomic<int64_t>* const bytes_counter_;
  int64_t length_ = 0;
  std::vector<unsigned char*> blocks_;  // from budget_'s pool, head by head
};

}  // namespace attnserve::core
