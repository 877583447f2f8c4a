#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace attnserve::core {

// A batch of sequences of different lengths in one row-major float buffer, either padded
// ([batch, padded_length, width], rows past a sequence's length ignored) or packed
// ([sum(lengths), width], sequences back to back, no padding).
struct RaggedBatch {
  static constexpr int64_t kPacked = -1;

  const float* data = nullptr;
  int64_t width = 0;
  std::vector<int64_t> lengths;     // one per sequence, each >= 0
  int64_t padded_length = kPacked;  // rows reserved per sequence; kPacked: none reserved
  // Packed batches only, when not empty: sequence b's rows start at sequence_data[b] instead of
  // at its packed offset in `data` (then unused), so one batch can gather sequences that live in
  // several buffers (the server's merged calls) without copying them.
  std::vector<const float*> sequence_data;

  bool packed() const { return padded_length == kPacked; }
  bool segmented() const { return !sequence_data.empty(); }
  int64_t batch() const { return static_cast<int64_t>(lengths.size()); }
  int64_t total_length() const;  // sum of lengths: the valid tokens
  int64_t max_length() const;    // longest sequence (0 for an empty batch)
  int64_t rows() const;          // rows in `data`: packed total_length, padded batch*padded_length
  // The sequence length the padded views use: padded_length, or max_length when packed.
  int64_t view_length() const { return packed() ? max_length() : padded_length; }
  // Row of `data` where each sequence starts (one pass, also when packed).
  std::vector<int64_t> row_offsets() const;
};

// Prefix sums of `lengths`: the first row of each sequence when they are packed back to back.
std::vector<int64_t> PackedOffsets(std::span<const int64_t> lengths);

}  // namespace attnserve::core
