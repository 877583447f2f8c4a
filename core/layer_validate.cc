// Layer::Validate: everything a call must satisfy before it runs (kind against the layer and
// the context, widths, lengths, sizes, finite values), each failure an InvalidArgument that says
// what is wrong. The forward pass (layer.cc) runs only on calls that passed it.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/layer.h"
#include "core/layer_limits.h"

namespace attnserve::core {
namespace {

// a * b when it stays within kMaxElements, else -1.
int64_t CheckedProduct(int64_t a, int64_t b) {
  int64_t product = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product) || product > kMaxElements) {
    return -1;
  }
  return product;
}

// The first non-finite value among the valid rows of `batch`, as an error naming its place.
absl::Status CheckFinite(const char* what, const RaggedBatch& batch) {
  if (batch.segmented()) {
    for (int64_t b = 0; b < batch.batch(); ++b) {
      const float* rows = batch.sequence_data[b];
      for (int64_t e = 0; e < batch.lengths[b] * batch.width; ++e) {
        if (!std::isfinite(rows[e])) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": sequence ", b, " element [",
                                                         e / batch.width, ", ", e % batch.width,
                                                         "] is not finite (", rows[e], ")"));
        }
      }
    }
    return absl::OkStatus();
  }
  const int64_t rows = batch.packed() ? batch.total_length() : batch.rows();
  const int64_t width = batch.width;
  // On this thread alone: validation runs on the transports' threads (one per HTTP connection),
  // and OpenMP would give each of them a team of threads of its own, living as long as it.
  int64_t bad_row = -1;
  for (int64_t r = 0; r < rows && bad_row < 0; ++r) {
    if (!batch.packed() && r % batch.padded_length >= batch.lengths[r / batch.padded_length]) {
      continue;  // padding is never read, so its contents do not matter
    }
    const float* row = batch.data + r * width;
    float sum = 0.0f;
    // inf * 0 and NaN * 0 are NaN: one vectorisable pass finds any non-finite value.
    for (int64_t c = 0; c < width; ++c) sum += row[c] * 0.0f;
    if (sum != sum) bad_row = r;
  }
  if (bad_row < 0) return absl::OkStatus();
  int64_t column = 0;
  while (std::isfinite(batch.data[bad_row * width + column])) ++column;
  // The element's index as the caller's tensor has it: [b, t, c] padded, [t, c] packed.
  const std::string at = batch.packed() ? absl::StrCat(bad_row, ", ", column)
                                        : absl::StrCat(bad_row / batch.padded_length, ", ",
                                                       bad_row % batch.padded_length, ", ", column);
  return absl::InvalidArgumentError(absl::StrCat(what, ": element [", at, "] is not finite (",
                                                 batch.data[bad_row * width + column], ")"));
}

// Width, padded length, lengths, sizes and data of one batch of a call.
absl::Status CheckBatch(const char* what, const RaggedBatch& batch, int64_t width,
                        const char* width_name) {
  if (batch.width != width) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " width ", batch.width, " != ", width_name, " ", width));
  }
  if (!batch.packed() && batch.padded_length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " padded length ", batch.padded_length, " is negative"));
  }
  int64_t total = 0;
  for (int64_t b = 0; b < batch.batch(); ++b) {
    const int64_t length = batch.lengths[b];
    if (length < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " length[", b, "] = ", length, " is negative"));
    }
    if (!batch.packed() && length > batch.padded_length) {
      return absl::InvalidArgumentError(absl::StrCat(what, " length[", b, "] = ", length,
                                                     " > padded length ", batch.padded_length));
    }
    total += std::min(length, kMaxElements);  // both < 2^33: the sum cannot overflow
    if (total > kMaxElements) break;
  }
  const int64_t rows = batch.packed() ? total : CheckedProduct(batch.batch(), batch.padded_length);
  if (total > kMaxElements || rows < 0 || CheckedProduct(rows, std::max<int64_t>(width, 1)) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is too large: ", batch.batch(),
                                                   " sequences, padded length ",
                                                   batch.padded_length, ", width ", width));
  }
  if (batch.segmented()) {
    if (!batch.packed() || batch.sequence_data.size() != batch.lengths.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " has sequence_data for ", batch.sequence_data.size(), " sequences of ",
          batch.batch(), (batch.packed() ? "" : " and is padded (segments are packed only)")));
    }
    for (int64_t b = 0; b < batch.batch(); ++b) {
      if (batch.sequence_data[b] == nullptr && batch.lengths[b] > 0) {
        return absl::InvalidArgumentError(absl::StrCat(what, " sequence ", b, " data is null"));
      }
    }
  } else if (batch.data == nullptr && rows > 0 && width > 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " data is null but has ", rows, " rows"));
  }
  return CheckFinite(what, batch);
}

// The buffers a valid call implies (scratch and the attention output) stay within
// kMaxElements, so a forged shape is refused rather than allocated.
absl::Status CheckCallSize(const LayerSpec& spec, const ForwardArgs& args) {
  const RaggedBatch& kv = args.context ? *args.context : args.input;
  const int64_t tokens = MatmulRows(args.input.total_length());
  const int64_t kv_tokens = MatmulRows(kv.total_length());
  const int64_t widest = std::max({3 * spec.inner(), spec.d_model, spec.d_output()});
  int64_t probabilities = 0;
  if (args.return_attention) {
    probabilities = CheckedProduct(CheckedProduct(args.input.batch(), spec.num_heads),
                                   CheckedProduct(args.input.view_length(), kv.view_length()));
    if (probabilities < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attention probabilities of ", args.input.batch(), " x ", spec.num_heads, " x ",
          args.input.view_length(), " x ", kv.view_length(), " are too large to return"));
    }
  }
  if (CheckedProduct(tokens, widest) < 0 || CheckedProduct(kv_tokens, 2 * spec.inner()) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("call too large: ", tokens, " tokens, ", kv_tokens, " context tokens"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Layer::Validate(const ForwardArgs& args) const {
  const LayerSpec& spec = this->spec();
  const AttentionKind kind = args.kind;
  if (kind != AttentionKind::kBidirectional && kind != AttentionKind::kCausal &&
      kind != AttentionKind::kCross && kind != AttentionKind::kCausalCross) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown attention kind ", static_cast<int>(kind)));
  }
  const bool cross = IsCross(kind);
  if (cross && !args.context) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(KindName(kind)), " attention needs a context"));
  }
  if (!cross && args.context) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(KindName(kind)), " attention takes no context (only the cross kinds do)"));
  }
  if (!spec.Serves(kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(KindName(kind)),
                     " attention needs d_context == d_model; this layer has d_context ",
                     spec.d_context, " != d_model ", spec.d_model, " (cross kinds only)"));
  }
  if (absl::Status s = CheckBatch("input", args.input, spec.d_model, "d_model"); !s.ok()) {
    return s;
  }
  if (cross) {
    const RaggedBatch& context = *args.context;
    if (context.batch() != args.input.batch()) {
      return absl::InvalidArgumentError(
          absl::StrCat("context batch ", context.batch(), " != input batch ", args.input.batch()));
    }
    if (absl::Status s = CheckBatch("context", context, spec.d_context, "d_context"); !s.ok()) {
      return s;
    }
  }
  return CheckCallSize(spec, args);
}

absl::Status Layer::ValidateBatch(const RaggedBatch& batch, bool context, const char* what) const {
  const LayerSpec& spec = this->spec();
  return context ? CheckBatch(what, batch, spec.d_context, "d_context")
                 : CheckBatch(what, batch, spec.d_model, "d_model");
}

bool AllFinite(std::span<const float> values) {
  // Infinities and NaNs are the floats whose exponent bits are all set: an integer OR over the
  // values vectorises (a float sum would not, its order being fixed), about 0.8 us for 4096.
  uint32_t non_finite = 0;
  for (const float value : values) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    non_finite |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return non_finite == 0;
}

absl::Status OutputNotFinite(int64_t sequence) {
  return absl::InvalidArgumentError(
      absl::StrCat("sequence ", sequence,
                   ": the output is not finite: the layer overflowed float32 on its inputs "
                   "(values this large cannot be computed; scale them down)"));
}

absl::Status CheckOutputFinite(const RaggedBatch& input, std::span<const float> output,
                               int64_t width) {
  const float* row = output.data();
  for (int64_t b = 0; b < input.batch(); ++b) {
    const int64_t count = input.lengths[b] * width;
    if (!AllFinite({row, static_cast<size_t>(count)})) return OutputNotFinite(b);
    row += input.packed() ? count : input.padded_length * width;
  }
  return absl::OkStatus();
}

}  // namespace attnserve::core
