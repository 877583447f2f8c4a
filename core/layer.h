#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/kv_cache.h"
#include "core/layer_spec.h"
#include "core/ragged_batch.h"
#include "core/weights.h"

namespace attnserve::core {

// One forward call: which kind, the queries' batch and, for the cross kinds, the context's.
struct ForwardArgs {
  AttentionKind kind = AttentionKind::kBidirectional;
  RaggedBatch input;                   // width d_model
  std::optional<RaggedBatch> context;  // width d_context; present exactly for the cross kinds
  bool return_attention = false;
};

// Sizes of what Forward writes, so a caller can provide the buffers (e.g. inside a reply).
struct ForwardShapes {
  int64_t output_rows = 0;   // = input.rows(): the output has the input's layout
  int64_t output_width = 0;  // spec.d_output()
  // [batch, num_heads, input.view_length(), kv.view_length()] when asked for, else all 0.
  int64_t attention_dims[4] = {0, 0, 0, 0};

  int64_t output_size() const { return output_rows * output_width; }
  int64_t attention_size() const;
};

// One sequence's part of a decode step (Layer::Decode): its new tokens and where its keys and
// values are cached.
struct DecodeSequence {
  const float* input = nullptr;  // [tokens, d_model], row-major: the new tokens
  int64_t tokens = 0;
  // Query tokens this sequence has had before this step: the first new token's position.
  int64_t position = 0;
  // kCausal: the keys and values of positions 0 .. position - 1 (length() == position); the
  // step appends the new tokens' (the caller has reserved room for position + tokens).
  KvSequence* cache = nullptr;
  // kCausalCross: the context's keys and values (Layer::ProjectContext), projected at least as
  // far as these tokens see: min(position + tokens, context_length) rows (Decode checks it), and
  // the context's whole length, projected or not.
  const KvSequence* context = nullptr;
  int64_t context_length = 0;
  float* output = nullptr;  // [tokens, d_output()]
};

// Context rows to project (Layer::ProjectContext): `tokens` rows at `rows` ([tokens, d_context],
// row-major) whose keys and values go to `kv` from its length on.
struct ContextRows {
  const float* rows = nullptr;
  int64_t tokens = 0;
  KvSequence* kv = nullptr;
};

// A loaded attention layer on the process's oneDNN CPU engine. Immutable once made:
// Forward may be called from several threads at once.
class Layer {
 public:
  // Takes the weights (checked with CheckWeights) and prepares them for `precision`. Never
  // throws: running out of memory is ResourceExhausted.
  static absl::StatusOr<std::shared_ptr<const Layer>> Create(LayerWeights weights,
                                                             Precision precision = Precision::kF32);
  ~Layer();

  const LayerSpec& spec() const;
  Precision precision() const;

  // Checks a call against this layer: widths vs d_model/d_context, lengths vs padded length,
  // negative lengths, context present exactly for cross kinds, self kinds on a cross-only layer.
  // InvalidArgument with a message that says what is wrong. The one place these are decided.
  absl::Status Validate(const ForwardArgs& args) const;

  // The checks Validate applies to one batch, for a decode step's tokens (`context` false:
  // width d_model) or a session's context (true: d_context): width, lengths, sizes, finite
  // values. InvalidArgument naming `what`.
  absl::Status ValidateBatch(const RaggedBatch& batch, bool context, const char* what) const;

  // The sizes of Forward's outputs for a valid call.
  ForwardShapes Shapes(const ForwardArgs& args) const;

  // Runs the layer. `output` has Shapes().output_size() floats, `attention` attention_size()
  // (empty when not asked). Padded rows of the output and masked probabilities are written 0.
  // Validates first; oneDNN failures come back as Internal and running out of memory as
  // ResourceExhausted, never as exceptions.
  absl::Status Forward(const ForwardArgs& args, std::span<float> output,
                       std::span<float> attention = {}) const;

  // Forward without Validate, for a caller that has validated `args` with this layer once
  // already (the server, at admission) and sized the buffers from Shapes(): a server should
  // not scan every tensor twice. Running out of memory is still ResourceExhausted.
  absl::Status ForwardValidated(const ForwardArgs& args, std::span<float> output,
                                std::span<float> attention = {}) const;

  // The useful FLOPs of a valid call (no padding; causal attention counts its visible half).
  // Below kSerialFlops, Forward runs it on the calling thread alone.
  double Flops(const ForwardArgs& args) const;

  // Projects context rows to keys and values and caches them, the parts of many sequences (of
  // many sessions) as one matmul: a causal cross session's context, computed once, a part at a
  // time as its positions reach it. Each part's rows go to its `kv` from its length on (room
  // reserved by the caller); parts of one kv follow each other in order.
  absl::Status ProjectContext(std::span<const ContextRows> parts) const;

  // One decode step of many sequences (of many sessions) at once: the new tokens' projections
  // as one matmul over all of them, their keys and values appended to their caches (kCausal),
  // attention of each new token over its cache read in place, the output projection as one
  // matmul. A token at position p sees keys 0 .. p (kCausal, its own included) or context keys
  // 0 .. min(p, context length - 1) (kCausalCross, as Forward's top-left mask); none: 0. Each
  // output row equals the same row of a Forward over the whole sequence so far, within f32
  // rounding. `kind` must be one this layer serves (checked by the caller, like Validate).
  absl::Status Decode(AttentionKind kind, std::span<const DecodeSequence> sequences) const;

 private:
  struct Impl;
  explicit Layer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether a call's `output` (Forward's, laid out as `input`: padded or packed, `width` wide)
// is finite on every valid row: finite inputs can still overflow float32 inside the layer (say
// values near 3e38), and a reply must never carry a NaN or an infinity as a result. Otherwise
// InvalidArgument naming the first such sequence. One pass over the valid rows.
absl::Status CheckOutputFinite(const RaggedBatch& input, std::span<const float> output,
                               int64_t width);

// Whether every value is finite (no NaN, no infinity): one vectorised pass.
bool AllFinite(std::span<const float> values);

// The refusal of an output that is not finite (CheckOutputFinite's), naming `sequence`.
absl::Status OutputNotFinite(int64_t sequence);

}  // namespace attnserve::core
