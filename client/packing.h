#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "client/float_array.h"

namespace attnserve::client {

// Drops the padding of a [B, S, d] array: the first lengths[b] rows of each sequence, back to
// back, as [sum(lengths), d]. Empty lengths mean every sequence is S long.
absl::StatusOr<FloatArray> Pack(const FloatArray& padded, const std::vector<int32_t>& lengths);

// Spreads a packed [T, d] array over [B, padded_length, d] with zero padding rows.
absl::StatusOr<FloatArray> Unpack(const FloatArray& packed, const std::vector<int32_t>& lengths,
                                  int64_t padded_length);

// Parses "3,5,8" (the --lengths flags); an empty string is an empty list.
absl::StatusOr<std::vector<int32_t>> ParseIntList(const std::string& text);

}  // namespace attnserve::client
