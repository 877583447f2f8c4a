#include "core/ragged_batch.h"

#include <algorithm>
#include <numeric>

namespace attnserve::core {

int64_t RaggedBatch::total_length() const {
  return std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
}

int64_t RaggedBatch::max_length() const {
  return lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
}

int64_t RaggedBatch::rows() const { return packed() ? total_length() : batch() * padded_length; }

std::vector<int64_t> RaggedBatch::row_offsets() const {
  if (packed()) return PackedOffsets(lengths);
  std::vector<int64_t> offsets(lengths.size());
  for (size_t b = 0; b < lengths.size(); ++b) offsets[b] = static_cast<int64_t>(b) * padded_length;
  return offsets;
}

std::vector<int64_t> PackedOffsets(std::span<const int64_t> lengths) {
  std::vector<int64_t> offsets(lengths.size());
  int64_t next = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    offsets[b] = next;
    next += lengths[b];
  }
  return offsets;
}

}  // namespace attnserve::core
