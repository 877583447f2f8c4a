#include "server/frontends/tensor_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "raw tensors are little-endian float32, read in place");

// Sequences per batch. Empty sequences cost no tokens but a few words of bookkeeping each: a
// 64 MiB message of zero lengths would otherwise hold the worker for seconds and take gigabytes.
constexpr int64_t kMaxSequences = int64_t{1} << 16;

// Floats one reply tensor may hold: what a repeated field indexes with an int, and 2 GiB of raw
// bytes, the most a gRPC message can carry.
constexpr int64_t kMaxReplyFloats = (int64_t{1} << 29) - 1;

// "[2, 4, 256]".
std::string ShapeText(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Fills the batch's lengths from the wire's, or full lengths when none are given.
absl::Status DecodeLengths(std::span<const int64_t> shape, std::span<const int32_t> lengths,
                           absl::string_view what, core::RaggedBatch* batch) {
  const bool packed = shape.size() == 2;
  const int64_t sequences = packed ? std::max<int64_t>(lengths.size(), 1) : shape[0];
  if (sequences > kMaxSequences) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", sequences, " sequences in one call, over the limit of ", kMaxSequences));
  }
  if (packed) {
    const int64_t rows = shape[0];
    if (lengths.empty()) {
      batch->lengths = {rows};
      return absl::OkStatus();
    }
    int64_t sum = 0;
    for (int32_t length : lengths) {
      if (length < 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, " lengths: negative length ", length));
      }
      sum += length;
    }
    if (sum != rows) {
      return absl::InvalidArgumentError(absl::StrCat(what, " lengths sum to ", sum,
                                                     " but the packed tensor has ", rows, " rows"));
    }
  } else {
    const int64_t batch_size = shape[0];
    batch->padded_length = shape[1];
    if (lengths.empty()) {
      batch->lengths.assign(batch_size, batch->padded_length);
      return absl::OkStatus();
    }
    if (static_cast<int64_t>(lengths.size()) != batch_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", lengths.size(), " lengths for a batch of ", batch_size));
    }
  }
  batch->lengths.assign(lengths.begin(), lengths.end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> ElementCount(std::span<const int64_t> shape, absl::string_view what) {
  const int rank = static_cast<int>(shape.size());
  if (rank != 2 && rank != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shape must be [B, S, width] (padded) or [T, width] (packed), got rank ", rank,
        rank == 0 ? " (shape missing)" : ""));
  }
  int64_t count = 1;
  for (const int64_t dim : shape) {
    if (dim <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shape ", ShapeText(shape), " has a non-positive dimension"));
    }
    if (count > std::numeric_limits<int64_t>::max() / 4 / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": shape ", ShapeText(shape), " is too large"));
    }
    count *= dim;
  }
  return count;
}

absl::StatusOr<const float*> RawFloats(absl::string_view bytes, int64_t count,
                                       std::vector<float>* copy) {
  if (static_cast<int64_t>(bytes.size()) != count * static_cast<int64_t>(sizeof(float))) {
    return absl::InvalidArgumentError(absl::StrCat("holds ", bytes.size(), " bytes for ", count,
                                                   " float32 elements (", count * 4, " bytes)"));
  }
  if (count == 0) return copy->data();
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(float) == 0) {
    return reinterpret_cast<const float*>(bytes.data());
  }
  copy->resize(count);
  std::memcpy(copy->data(), bytes.data(), bytes.size());
  return copy->data();
}

absl::Status MakeBatch(std::span<const int64_t> shape, const float* data,
                       std::span<const int32_t> lengths, absl::string_view what,
                       core::RaggedBatch* batch) {
  batch->data = data;
  batch->width = shape.back();
  batch->padded_length = core::RaggedBatch::kPacked;
  return DecodeLengths(shape, lengths, what, batch);
}

absl::Status CheckReplyFloats(int64_t count) {
  if (count < 0 || count > kMaxReplyFloats) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a reply tensor of ", count, " floats is over the limit of ", kMaxReplyFloats));
  }
  return absl::OkStatus();
}

int64_t ForwardReplyBytes(const core::ForwardShapes& shapes) {
  return (shapes.output_size() + shapes.attention_size()) * int64_t{sizeof(float)} + 64;
}

std::vector<int64_t> OutputShape(const core::RaggedBatch& input,
                                 const core::ForwardShapes& shapes) {
  if (input.packed()) return {shapes.output_rows, shapes.output_width};
  return {input.batch(), input.padded_length, shapes.output_width};
}

std::vector<int64_t> AttentionShape(const core::ForwardShapes& shapes) {
  return {std::begin(shapes.attention_dims), std::end(shapes.attention_dims)};
}

}  // namespace attnserve::server
