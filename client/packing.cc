#include "client/packing.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace attnserve::client {

absl::StatusOr<FloatArray> Pack(const FloatArray& padded, const std::vector<int32_t>& lengths) {
  if (padded.shape.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("packing needs a [B, S, d] array, got ", padded.ShapeString()));
  }
  const int64_t batch = padded.shape[0], seq = padded.shape[1], width = padded.shape[2];
  std::vector<int32_t> lens = lengths;
  if (lens.empty()) lens.assign(batch, static_cast<int32_t>(seq));
  if (static_cast<int64_t>(lens.size()) != batch) {
    return absl::InvalidArgumentError(
        absl::StrCat(lens.size(), " lengths for a batch of ", batch, " sequences"));
  }
  for (int32_t len : lens) {
    if (len < 0 || len > seq) {
      return absl::InvalidArgumentError(absl::StrCat("length ", len, " outside [0, ", seq, "]"));
    }
  }
  const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t{0});
  FloatArray packed{.shape = {total, width}, .values = {}};
  packed.values.reserve(total * width);
  for (int64_t b = 0; b < batch; ++b) {
    auto first = padded.values.begin() + b * seq * width;
    packed.values.insert(packed.values.end(), first, first + lens[b] * width);
  }
  return packed;
}

absl::StatusOr<FloatArray> Unpack(const FloatArray& packed, const std::vector<int32_t>& lengths,
                                  int64_t padded_length) {
  if (packed.shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("unpacking needs a [T, d] array, got ", packed.ShapeString()));
  }
  const int64_t width = packed.shape[1];
  const int64_t total = std::accumulate(lengths.begin(), lengths.end(), int64_t{0});
  const bool too_long = std::any_of(lengths.begin(), lengths.end(),
                                    [&](int32_t len) { return len < 0 || len > padded_length; });
  if (total != packed.shape[0] || too_long) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lengths do not fit packed shape ", packed.ShapeString(), " padded to ", padded_length));
  }
  const auto batch = static_cast<int64_t>(lengths.size());
  FloatArray padded{.shape = {batch, padded_length, width}, .values = {}};
  padded.values.assign(batch * padded_length * width, 0.0f);
  int64_t row = 0;
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(packed.values.begin() + row * width, lengths[b] * width,
                padded.values.begin() + b * padded_length * width);
    row += lengths[b];
  }
  return padded;
}

absl::StatusOr<std::vector<int32_t>> ParseIntList(const std::string& text) {
  std::vector<int32_t> list;
  if (text.empty()) return list;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t value = 0;
    if (!absl::SimpleAtoi(part, &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", part, "' in '", text, "' is not an integer"));
    }
    list.push_back(value);
  }
  return list;
}

}  // namespace attnserve::client
