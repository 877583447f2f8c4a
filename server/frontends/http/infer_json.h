#pragma once

// The Open Inference Protocol's REST inference request and reply (JSON, and Triton's binary
// tensor data extension) converted straight to and from core::ForwardArgs, under the same
// tensor contract as the gRPC form (docs/open-inference-protocol.md; the names are
// infer_codec.h's). Float text is parsed into a float vector in one pass of simdjson, without a
// ModelInferRequest in between (docs/http.md says why, with the measurement). No transport in
// here: the fuzz harness calls it on raw bytes.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer.h"
#include "server/frontends/oip/sequence_step.h"
#include "server/serving/job.h"

namespace attnserve::server {

// Bytes the JSON parser may read past the end of a body (simdjson's padding): a body buffer
// with this much spare capacity is parsed in place.
inline constexpr size_t kJsonPadding = 64;

// One output of the reply: which, how it travels, and its values once computed.
struct HttpOutput {
  std::string name;
  bool binary = false;  // Triton's binary tensor data extension: raw little-endian bytes
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// A REST inference request seen as a Forward call, pointing into the body where the bytes
// allow (binary FP32 data, aligned).
struct DecodedHttpInfer {
  DecodedHttpInfer() = default;
  DecodedHttpInfer(const DecodedHttpInfer&) = delete;
  DecodedHttpInfer& operator=(const DecodedHttpInfer&) = delete;

  core::ForwardArgs args;
  std::string id;                               // echoed
  bool kind_given = false;                      // the parameter `kind` was given
  std::optional<SequenceParams> sequence;       // a step of this sequence (parameter sequence_id)
  std::vector<HttpOutput> outputs;              // the reply's, in order
  std::vector<float> input_copy, context_copy;  // parsed text, converted or realigned bytes
  std::vector<int32_t> lengths_copy, context_lengths_copy;
  std::vector<float> output_scratch;  // Forward's output when the caller did not ask for it
};

// Decodes a request body: `body` is JSON, or, when `json_length` >= 0 (the request's
// Inference-Header-Content-Length), `json_length` bytes of JSON followed by the binary tensors
// in the order of the inputs that give `binary_data_size`. `body` must stay alive while
// `decoded` is used. When `body_capacity` >= body.size() + kJsonPadding (the bytes past the
// end are readable) an all-JSON body is parsed in place, else it is copied. InvalidArgument
// with a message for anything that is not such a request, or breaks the contract.
absl::Status DecodeHttpInfer(absl::string_view body, size_t body_capacity, int64_t json_length,
                             DecodedHttpInfer* decoded);

// Bytes the reply takes, a little over: JSON text for text outputs, 4 a float for binary ones.
int64_t HttpReplyBytes(const DecodedHttpInfer& decoded, const core::ForwardShapes& shapes);

// Sizes the outputs (zero-filled) for `shapes` and returns where Forward writes.
absl::StatusOr<ForwardBuffers> PrepareHttpOutputs(const core::ForwardShapes& shapes,
                                                  DecodedHttpInfer* decoded);

// The reply: a JSON document, then (binary outputs) their bytes, in order.
struct HttpInferReply {
  std::string json;
  std::vector<std::span<const char>> binary;  // into decoded.outputs' values
};

// Encodes the reply of a computed call for `model`.
HttpInferReply EncodeHttpInfer(absl::string_view model, int64_t version,
                               const DecodedHttpInfer& decoded);

}  // namespace attnserve::server
