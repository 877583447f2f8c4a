#include "core/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include "absl/strings/str_cat.h"
#include "core/dnnl_context.h"

namespace attnserve::core {

bool KvCacheBudget::TryCharge(int64_t bytes) {
  if (bytes < 0) return false;  // a charge never gives room back: Release does
  int64_t used = used_.load();
  do {
    if (bytes > limit_ - used) return false;  // (used <= limit_: never overflows)
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

KvSequence::KvSequence(int64_t width, int64_t head_dim, KvPrecision precision,
                       KvCacheBudget* budget, std::atomic<int64_t>* bytes_counter)
    : width_(width),
      head_dim_(head_dim),
      precision_(precision),
      budget_(budget),
      bytes_counter_(bytes_counter) {}

KvSequence::~KvSequence() { FreeBlocksFrom(0); }

int64_t KvSequence::block_bytes() const { return width_ / head_dim_ * head_bytes(); }

int64_t KvSequence::bytes() const { return static_cast<int64_t>(blocks_.size()) * block_bytes(); }

int64_t KvSequence::head_bytes() const {
  // bf16 pads an odd head_dim to even (its keys pair dimensions): 64 * ((head_dim + 1) / 2 * 2)
  // bytes, a whole number of cache lines, as f32's 128 * head_dim.
  if (precision_ == KvPrecision::kBF16) return 2 * kKvBlockTokens * ((head_dim_ + 1) / 2 * 2) * 2;
  return 2 * kKvBlockTokens * head_dim_ * 4;
}

absl::Status KvCacheFull(const KvCacheBudget& budget, int64_t more, absl::string_view what) {
  return absl::ResourceExhaustedError(
      absl::StrCat("the KV cache is full: ", budget.used(), " of ", budget.limit(),
                   " bytes are in use (sessions' caches and bookkeeping, --kv-cache-mib); ", what,
                   " needs ", more, " more"));
}

namespace {

// The refusal of a block the budget had room for but the pool could not give (`why`).
absl::Status KvPoolFull(const KvCacheBudget& budget, int64_t block_bytes,
                        KvBlockPool::Refusal why) {
  const KvBlockPool& pool = budget.pool();
  if (!pool.reserved()) {
    return absl::ResourceExhaustedError(
        "the KV cache has no memory: its address space could not be reserved (--kv-cache-mib)");
  }
  if (why == KvBlockPool::Refusal::kNoMemory) {
    return absl::ResourceExhaustedError(
        "out of memory for the KV cache: the system refused a slab");
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the KV cache is full: its slabs (", pool.region_bytes() >> 20,
      " MiB) are held by blocks of other sizes, none with room for a block of ", block_bytes,
      " bytes (a slab holds blocks of one size: sessions of models of other widths or cache "
      "precisions hold them); ",
      budget.used(), " of ", budget.limit(), " bytes are in use (--kv-cache-mib)"));
}

}  // namespace

int64_t KvSequence::BytesToReserve(int64_t length) const {
  const int64_t needed = (length + kKvBlockTokens - 1) / kKvBlockTokens;
  return std::max<int64_t>(needed - static_cast<int64_t>(blocks_.size()), 0) * block_bytes();
}

absl::Status KvSequence::Reserve(int64_t length) {
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("a sequence of ", length, " tokens"));
  }
  const int64_t more = BytesToReserve(length);
  if (more == 0) return absl::OkStatus();
  const size_t needed = static_cast<size_t>((length + kKvBlockTokens - 1) / kKvBlockTokens);
  if (!budget_->TryCharge(more)) return KvCacheFull(*budget_, more);
  const size_t before = blocks_.size();
  // What this call took goes back: its blocks and its charge.
  auto undo = [&] {
    for (size_t b = before; b < blocks_.size(); ++b)
      budget_->pool().Free(blocks_[b], block_bytes());
    blocks_.resize(before);
    budget_->Release(more);
  };
  try {
    blocks_.reserve(needed);
  } catch (const std::exception&) {  // bad_alloc, or length_error past what a vector holds
    undo();
    return absl::ResourceExhaustedError("out of memory for the KV cache");
  }
  // Blocks start on a cache line (the pool's promise), and so does each head's part
  // (head_bytes is a multiple of 64).
  while (blocks_.size() < needed) {
    KvBlockPool::Refusal why;
    unsigned char* block = budget_->pool().Allocate(block_bytes(), &why);
    if (block == nullptr) {
      undo();
      return KvPoolFull(*budget_, block_bytes(), why);
    }
    blocks_.push_back(block);
  }
  if (bytes_counter_ != nullptr) bytes_counter_->fetch_add(more);
  return absl::OkStatus();
}

void KvSequence::Write(int64_t position, const float* key, const float* value) {
  unsigned char* block = blocks_[position / kKvBlockTokens];
  const int64_t row = position % kKvBlockTokens;
  // Head by head: its keys, then its values, in the layouts head() describes.
  for (int64_t h = 0; h < width_ / head_dim_; ++h) {
    const float* k = key + h * head_dim_;
    const float* v = value + h * head_dim_;
    if (precision_ == KvPrecision::kBF16) {
      auto* keys = reinterpret_cast<uint16_t*>(block + h * head_bytes());
      uint16_t* values = keys + (head_dim_ + 1) / 2 * 2 * kKvBlockTokens;
      for (int64_t c = 0; c < head_dim_; ++c) {
        ConvertToBf16(k + c, keys + c / 2 * 2 * kKvBlockTokens + 2 * row + c % 2, 1);
        ConvertToBf16(v + c, values + row / 2 * 2 * head_dim_ + 2 * c + row % 2, 1);
      }
    } else {
      auto* keys = reinterpret_cast<float*>(block + h * head_bytes());
      for (int64_t c = 0; c < head_dim_; ++c) keys[c * kKvBlockTokens + row] = k[c];
      std::memcpy(keys + kKvBlockTokens * head_dim_ + row * head_dim_, v,
                  head_dim_ * sizeof(float));
    }
  }
  length_ = std::max(length_, position + 1);
}

void KvSequence::Truncate(int64_t length) {
  Rewind(length);
  Shrink();
}

void KvSequence::Shrink() {
  FreeBlocksFrom(static_cast<size_t>((length_ + kKvBlockTokens - 1) / kKvBlockTokens));
}

void KvSequence::FreeBlocksFrom(size_t first) {
  if (first >= blocks_.size()) return;
  const int64_t freed = static_cast<int64_t>(blocks_.size() - first) * block_bytes();
  for (size_t b = first; b < blocks_.size(); ++b) budget_->pool().Free(blocks_[b], block_bytes());
  blocks_.resize(first);
  budget_->Release(freed);
  if (bytes_counter_ != nullptr) bytes_counter_->fetch_sub(freed);
}

}  // namespace attnserve::core
