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

// Packed offsets are a prefix sum; callers that walk every sequence should accumulate
// themselves rather than call this in a loop (it is O(b) when packed).
int64_t RaggedBatch::row_offset(int64_t b) const {
  if (!packed()) return b * padded_length;
  return std::accumulate(lengths.begin(), lengths.begin() + b, int64_t{0});
}

}  // namespace attnserve::core
