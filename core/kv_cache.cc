#include "core/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "core/dnnl_context.h"

namespace attnserve::core {

bool KvCacheBudget::TryCharge(int64_t bytes) {
  int64_t used = used_.load();
  do {
    if (used + bytes > limit_) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

KvSequence::KvSequence(int64_t width, KvPrecision precision, KvCacheBudget* budget,
                       std::atomic<int64_t>* bytes_counter)
    : width_(width), precision_(precision), budget_(budget), bytes_counter_(bytes_counter) {}

KvSequence::~KvSequence() { FreeBlocksFrom(0); }

int64_t KvSequence::block_bytes() const {
  const int64_t element = precision_ == KvPrecision::kBF16 ? 2 : 4;
  return 2 * kKvBlockTokens * width_ * element;
}

int64_t KvSequence::bytes() const { return static_cast<int64_t>(blocks_.size()) * block_bytes(); }

const void* KvSequence::values(int64_t b) const { return blocks_[b].get() + block_bytes() / 2; }

absl::Status KvSequence::Reserve(int64_t length) {
  const size_t needed = static_cast<size_t>((length + kKvBlockTokens - 1) / kKvBlockTokens);
  if (needed <= blocks_.size()) return absl::OkStatus();
  const int64_t more = static_cast<int64_t>(needed - blocks_.size()) * block_bytes();
  if (!budget_->TryCharge(more)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the KV cache is full: ", budget_->used(), " of ", budget_->limit(),
        " bytes are held by sessions (--kv-cache-mib); this step needs ", more, " more"));
  }
  const size_t before = blocks_.size();
  try {
    while (blocks_.size() < needed) {
      blocks_.push_back(std::unique_ptr<unsigned char[]>(new unsigned char[block_bytes()]));
    }
  } catch (const std::bad_alloc&) {
    blocks_.resize(before);
    budget_->Release(more);
    return absl::ResourceExhaustedError("out of memory for the KV cache");
  }
  if (bytes_counter_ != nullptr) bytes_counter_->fetch_add(more);
  return absl::OkStatus();
}

void KvSequence::Write(int64_t position, const float* key, const float* value) {
  unsigned char* block = blocks_[position / kKvBlockTokens].get();
  const int64_t row = position % kKvBlockTokens;
  // Keys column-major in the block ([width][kKvBlockTokens]), values row-major.
  if (precision_ == KvPrecision::kBF16) {
    auto* keys = reinterpret_cast<uint16_t*>(block);
    for (int64_t c = 0; c < width_; ++c) ConvertToBf16(key + c, keys + c * kKvBlockTokens + row, 1);
    ConvertToBf16(value, keys + (kKvBlockTokens + row) * width_, width_);
  } else {
    auto* keys = reinterpret_cast<float*>(block);
    for (int64_t c = 0; c < width_; ++c) keys[c * kKvBlockTokens + row] = key[c];
    std::memcpy(keys + (kKvBlockTokens + row) * width_, value, width_ * sizeof(float));
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
  blocks_.resize(first);
  budget_->Release(freed);
  if (bytes_counter_ != nullptr) bytes_counter_->fetch_sub(freed);
}

}  // namespace attnserve::core
