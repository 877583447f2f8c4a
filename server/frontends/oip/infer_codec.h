#pragma once

// Conversion between the Open Inference Protocol's ModelInferRequest/ModelInferResponse and
// core::ForwardArgs, under attnserve's tensor contract (README.md, "Open Inference Protocol"):
// inputs `input`, `lengths`, `context`, `context_lengths`; parameters `kind`,
// `return_attention`; outputs `output`, `attention`. Only the protocol's encoding is checked
// here (names, datatypes, shapes vs byte counts, raw vs typed), each message naming the tensor;
// everything about the layer is core::Layer::Validate's, run once by admission.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/layer.h"
#include "inference/grpc_service.pb.h"
#include "server/serving/job.h"

namespace attnserve::server {

// The contract's tensor and parameter names.
inline constexpr char kInferInput[] = "input";
inline constexpr char kInferLengths[] = "lengths";
inline constexpr char kInferContext[] = "context";
inline constexpr char kInferContextLengths[] = "context_lengths";
inline constexpr char kInferOutput[] = "output";
inline constexpr char kInferAttention[] = "attention";
inline constexpr char kInferKindParameter[] = "kind";
inline constexpr char kInferReturnAttentionParameter[] = "return_attention";

// A ModelInferRequest seen as a Forward call, pointing into the request's own buffers where the
// bytes allow (FP32, aligned), plus how the reply is encoded.
struct DecodedInfer {
  DecodedInfer() = default;
  DecodedInfer(const DecodedInfer&) = delete;
  DecodedInfer& operator=(const DecodedInfer&) = delete;

  core::ForwardArgs args;
  bool raw_encoding = false;         // inputs came in raw_input_contents: answer raw
  std::vector<std::string> outputs;  // the reply's outputs, in order
  // Converted (FP16, BF16) or realigned inputs, and lengths copied out of raw bytes.
  std::vector<float> input_copy, context_copy;
  std::vector<int32_t> lengths_copy, context_lengths_copy;
  std::vector<float> output_scratch;  // Forward's output when the caller did not ask for it
};

// Decodes `request` into `decoded` (which then points into `request`: keep it alive).
// InvalidArgument, naming the tensor or parameter, for anything the contract does not allow.
absl::Status DecodeInferRequest(const inference::ModelInferRequest& request, DecodedInfer* decoded);

// Fills `response` for `request`: model, `version` (the one that computed it), id, and the
// requested outputs in FP32, sized and zero-filled in the request's encoding; returns where
// Forward writes. ResourceExhausted for a size the reply cannot hold.
absl::StatusOr<ForwardBuffers> PrepareInferResponse(const inference::ModelInferRequest& request,
                                                    DecodedInfer* decoded,
                                                    const core::ForwardShapes& shapes,
                                                    int64_t version,
                                                    inference::ModelInferResponse* response);

// The bytes of `request`'s reply for `shapes`, at most: the tensors, its id and model name.
int64_t InferReplyBytes(const inference::ModelInferRequest& request,
                        const core::ForwardShapes& shapes);

// The version a model_version names: 0 (the newest ready one) for "", else a positive decimal
// integer; NotFound otherwise. The one reading of it for every method.
absl::StatusOr<uint64_t> ParseModelVersion(absl::string_view version);

}  // namespace attnserve::server
