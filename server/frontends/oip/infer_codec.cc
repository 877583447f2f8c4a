#include "server/frontends/oip/infer_codec.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <span>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/float16.h"
#include "core/layer_spec.h"
#include "server/frontends/oip/sequence_step.h"
#include "server/frontends/tensor_codec.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "raw tensors are little-endian, read in place");

using inference::InferParameter;
using inference::InferTensorContents;
using inference::ModelInferRequest;
using InputTensor = inference::ModelInferRequest::InferInputTensor;
using Parameters = google::protobuf::Map<std::string, InferParameter>;

// The input tensors of the contract, in the order ModelMetadata lists them.
constexpr const char* kInputNames[] = {kInferInput, kInferLengths, kInferContext,
                                       kInferContextLengths};

// The client's names and strings are quoted Clipped: a huge one cannot swell the error.
absl::Status Invalid(absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tensor '", Clipped(tensor), "': ", what));
}

// The shape of `tensor`.
std::span<const int64_t> Shape(const InputTensor& tensor) {
  return {tensor.shape().data(), static_cast<size_t>(tensor.shape_size())};
}

// Elements in every typed field of `contents` but `kept` (a field number).
int64_t OtherContents(const InferTensorContents& contents, int kept) {
  const int64_t sizes[] = {contents.bool_contents_size(),   contents.int_contents_size(),
                           contents.int64_contents_size(),  contents.uint_contents_size(),
                           contents.uint64_contents_size(), contents.fp32_contents_size(),
                           contents.fp64_contents_size(),   contents.bytes_contents_size()};
  int64_t other = 0;
  for (int field = 1; field <= 8; ++field) {
    if (field != kept) other += sizes[field - 1];
  }
  return other;
}

// Where one input tensor's data is: its raw bytes (raw encoding) or its typed contents.
struct TensorSource {
  const InputTensor* tensor = nullptr;
  const std::string* raw = nullptr;  // null for typed contents
};

// Reads a float tensor (FP32 in place where aligned; FP16, BF16 converted into `copy`).
absl::StatusOr<const float*> FloatData(const TensorSource& source, int64_t count,
                                       std::vector<float>* copy) {
  const InputTensor& tensor = *source.tensor;
  const std::string& type = tensor.datatype();
  const bool half = type == "FP16" || type == "BF16";
  if (type != "FP32" && !half) {
    return Invalid(tensor.name(), absl::StrCat("datatype '", Clipped(type),
                                               "' is not served; send FP32, FP16 or BF16"));
  }
  if (source.raw == nullptr) {
    if (half) {
      return Invalid(tensor.name(), absl::StrCat(type,
                                                 " has no typed contents in the protocol; "
                                                 "send it in raw_input_contents"));
    }
    const InferTensorContents& contents = tensor.contents();
    if (OtherContents(contents, InferTensorContents::kFp32ContentsFieldNumber) > 0) {
      return Invalid(tensor.name(), "FP32 data goes in fp32_contents, not another contents field");
    }
    if (contents.fp32_contents_size() != count) {
      return Invalid(tensor.name(),
                     absl::StrCat(contents.fp32_contents_size(), " fp32_contents for a shape of ",
                                  count, " elements"));
    }
    return contents.fp32_contents().data();
  }
  const std::string& bytes = *source.raw;
  if (!half) {
    absl::StatusOr<const float*> data = RawFloats(bytes, count, copy);
    if (!data.ok())
      return Invalid(tensor.name(), absl::StrCat("raw_input_contents ", data.status().message()));
    return data;
  }
  if (static_cast<int64_t>(bytes.size()) != count * 2) {
    return Invalid(tensor.name(),
                   absl::StrCat("raw_input_contents holds ", bytes.size(), " bytes for ", count,
                                " ", type, " elements (", count * 2, " bytes)"));
  }
  // Converted at the edge: the layer computes in float32 whatever the wire carried.
  copy->resize(count);
  const bool fp16 = type == "FP16";
  for (int64_t i = 0; i < count; ++i) {
    uint16_t value;
    std::memcpy(&value, bytes.data() + 2 * i, sizeof(value));
    (*copy)[i] = fp16 ? core::HalfToFloat(value) : core::BFloat16ToFloat(value);
  }
  return copy->data();
}

// Reads a lengths tensor: INT32 [B], raw (copied out, any alignment) or in int_contents.
absl::StatusOr<std::span<const int32_t>> LengthsData(const TensorSource& source,
                                                     std::vector<int32_t>* copy) {
  const InputTensor& tensor = *source.tensor;
  if (tensor.datatype() != "INT32") {
    return Invalid(tensor.name(), absl::StrCat("datatype '", Clipped(tensor.datatype()),
                                               "' is not served; send INT32"));
  }
  if (tensor.shape_size() != 1 || tensor.shape(0) < 0) {
    return Invalid(tensor.name(), absl::StrCat("shape must be [B], got [",
                                               absl::StrJoin(tensor.shape(), ", "), "]"));
  }
  const int64_t count = tensor.shape(0);
  if (source.raw == nullptr) {
    const InferTensorContents& contents = tensor.contents();
    if (OtherContents(contents, InferTensorContents::kIntContentsFieldNumber) > 0) {
      return Invalid(tensor.name(), "INT32 data goes in int_contents, not another contents field");
    }
    if (contents.int_contents_size() != count) {
      return Invalid(tensor.name(),
                     absl::StrCat(contents.int_contents_size(), " int_contents for a shape of ",
                                  count, " elements"));
    }
    return std::span<const int32_t>(contents.int_contents().data(), count);
  }
  // (Divided, not multiplied: a shape of 2^62 elements times 4 wraps to 0 bytes.)
  if (count < 0 || source.raw->size() % 4 != 0 ||
      static_cast<int64_t>(source.raw->size() / 4) != count) {
    return Invalid(tensor.name(), absl::StrCat("raw_input_contents holds ", source.raw->size(),
                                               " bytes for ", count, " INT32 elements"));
  }
  copy->resize(count);
  std::memcpy(copy->data(), source.raw->data(), source.raw->size());
  return std::span<const int32_t>(*copy);
}

// One batch tensor (`input` or `context`) and its optional lengths, decoded into `batch`.
absl::Status DecodeBatch(const TensorSource& data, const TensorSource* lengths,
                         std::vector<float>* copy, std::vector<int32_t>* lengths_copy,
                         core::RaggedBatch* batch) {
  const std::string& name = data.tensor->name();
  absl::StatusOr<int64_t> count =
      ElementCount(Shape(*data.tensor), absl::StrCat("tensor '", Clipped(name), "'"));
  if (!count.ok()) return count.status();
  absl::StatusOr<const float*> floats = FloatData(data, *count, copy);
  if (!floats.ok()) return floats.status();
  std::span<const int32_t> given;
  if (lengths != nullptr) {
    absl::StatusOr<std::span<const int32_t>> read = LengthsData(*lengths, lengths_copy);
    if (!read.ok()) return read.status();
    given = *read;
  }
  return MakeBatch(Shape(*data.tensor), *floats, given,
                   absl::StrCat("tensor '", Clipped(name), "'"), batch);
}

// The `kind` parameter: a string naming the kind; bidirectional when absent, so tools that
// send only tensors (perf_analyzer) work.
absl::StatusOr<core::AttentionKind> KindParameter(const Parameters& parameters) {
  const auto it = parameters.find(kInferKindParameter);
  if (it == parameters.end()) return core::AttentionKind::kBidirectional;
  if (it->second.parameter_choice_case() != InferParameter::kStringParam) {
    return absl::InvalidArgumentError("parameter 'kind' must be a string_param");
  }
  const std::optional<core::AttentionKind> kind = core::KindFromName(it->second.string_param());
  if (!kind.has_value()) {
    std::vector<std::string> names;
    for (core::AttentionKind k : core::kAttentionKinds) names.emplace_back(core::KindName(k));
    return absl::InvalidArgumentError(absl::StrCat("parameter 'kind': unknown kind '",
                                                   Clipped(it->second.string_param()), "'; one of ",
                                                   absl::StrJoin(names, ", ")));
  }
  return *kind;
}

// The `return_attention` parameter: a bool, false when absent.
absl::StatusOr<bool> ReturnAttentionParameter(const Parameters& parameters) {
  const auto it = parameters.find(kInferReturnAttentionParameter);
  if (it == parameters.end()) return false;
  if (it->second.parameter_choice_case() != InferParameter::kBoolParam) {
    return absl::InvalidArgumentError("parameter 'return_attention' must be a bool_param");
  }
  return it->second.bool_param();
}

// A request without sequence_id that sets sequence_start or sequence_end: SequenceFlagWithoutId
// (the flags' own types are checked where a sequence's request reads them).
absl::Status CheckNoSequenceFlags(const Parameters& parameters) {
  if (parameters.contains(kSequenceIdParameter)) return absl::OkStatus();
  for (const char* flag : {kSequenceStartParameter, kSequenceEndParameter}) {
    const auto it = parameters.find(flag);
    if (it != parameters.end() &&
        (it->second.parameter_choice_case() != InferParameter::kBoolParam ||
         it->second.bool_param())) {
      return SequenceFlagWithoutId(flag);
    }
  }
  return absl::OkStatus();
}

// The reply's outputs: those the caller named (each once, each one of ours), or `output` and,
// when return_attention is set, `attention`.
absl::Status ChooseOutputs(const ModelInferRequest& request, bool return_attention,
                           DecodedInfer* decoded) {
  decoded->outputs.clear();
  if (request.outputs_size() == 0) {
    decoded->outputs.push_back(kInferOutput);
    if (return_attention) decoded->outputs.push_back(kInferAttention);
    return absl::OkStatus();
  }
  for (const auto& requested : request.outputs()) {
    const std::string& name = requested.name();
    if (name != kInferOutput && name != kInferAttention) {
      return absl::InvalidArgumentError(absl::StrCat("requested output '", Clipped(name),
                                                     "' is not an output of the model (",
                                                     kInferOutput, ", ", kInferAttention, ")"));
    }
    if (std::find(decoded->outputs.begin(), decoded->outputs.end(), name) !=
        decoded->outputs.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("output '", Clipped(name), "' requested twice"));
    }
    decoded->outputs.push_back(name);
  }
  return absl::OkStatus();
}

// Each named input of the request with where its data is; InvalidArgument for an unknown or
// repeated name, or for raw and typed data mixed.
absl::Status FindInputs(const ModelInferRequest& request, TensorSource (&found)[4]) {
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents has ", request.raw_input_contents_size(), " entries for ",
                     request.inputs_size(), " inputs; send one per input"));
  }
  for (int i = 0; i < request.inputs_size(); ++i) {
    const InputTensor& tensor = request.inputs(i);
    const auto* name = std::find(std::begin(kInputNames), std::end(kInputNames), tensor.name());
    if (name == std::end(kInputNames)) {
      return Invalid(tensor.name(),
                     "not an input of the model (input, lengths, context, "
                     "context_lengths)");
    }
    TensorSource& source = found[name - std::begin(kInputNames)];
    if (source.tensor != nullptr) return Invalid(tensor.name(), "given twice");
    if (raw && tensor.has_contents() && OtherContents(tensor.contents(), 0) > 0) {
      return Invalid(tensor.name(), "both contents and raw_input_contents are set; send one");
    }
    source.tensor = &tensor;
    source.raw = raw ? &request.raw_input_contents(i) : nullptr;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeInferRequest(const ModelInferRequest& request, DecodedInfer* decoded) {
  core::ForwardArgs& args = decoded->args;
  absl::StatusOr<core::AttentionKind> kind = KindParameter(request.parameters());
  if (!kind.ok()) return kind.status();
  absl::StatusOr<bool> return_attention = ReturnAttentionParameter(request.parameters());
  if (!return_attention.ok()) return return_attention.status();
  if (absl::Status status = CheckNoSequenceFlags(request.parameters()); !status.ok()) {
    return status;
  }
  if (absl::Status status = ChooseOutputs(request, *return_attention, decoded); !status.ok()) {
    return status;
  }
  args.kind = *kind;
  // Attention is computed exactly when it is sent.
  args.return_attention = std::find(decoded->outputs.begin(), decoded->outputs.end(),
                                    kInferAttention) != decoded->outputs.end();

  TensorSource found[4];  // in kInputNames' order
  if (absl::Status status = FindInputs(request, found); !status.ok()) return status;
  const auto& [input, lengths, context, context_lengths] = found;
  if (input.tensor == nullptr) return Invalid(kInferInput, "missing: the model needs it");
  decoded->raw_encoding = input.raw != nullptr;
  absl::Status status = DecodeBatch(input, lengths.tensor != nullptr ? &lengths : nullptr,
                                    &decoded->input_copy, &decoded->lengths_copy, &args.input);
  if (!status.ok()) return status;
  if (context.tensor == nullptr) {
    if (context_lengths.tensor != nullptr) {
      return Invalid(kInferContextLengths, "given without a 'context' tensor");
    }
    args.context.reset();
    return absl::OkStatus();
  }
  args.context.emplace();
  return DecodeBatch(context, context_lengths.tensor != nullptr ? &context_lengths : nullptr,
                     &decoded->context_copy, &decoded->context_lengths_copy, &*args.context);
}

int64_t InferReplyBytes(const ModelInferRequest& request, const core::ForwardShapes& shapes) {
  // The tensors are ForwardResponse's; the id and the model's name come back too.
  return ForwardReplyBytes(shapes) +
         static_cast<int64_t>(request.id().size() + request.model_name().size());
}

absl::StatusOr<ForwardBuffers> PrepareInferResponse(const ModelInferRequest& request,
                                                    DecodedInfer* decoded,
                                                    const core::ForwardShapes& shapes,
                                                    int64_t version,
                                                    inference::ModelInferResponse* response) {
  response->set_model_name(request.model_name());
  response->set_model_version(absl::StrCat(version));
  response->set_id(request.id());
  const std::vector<int64_t> output_shape = OutputShape(decoded->args.input, shapes);
  const std::vector<int64_t> attention_shape = AttentionShape(shapes);
  ForwardBuffers buffers;
  for (const std::string& name : decoded->outputs) {
    const bool is_output = name == kInferOutput;
    const int64_t count = is_output ? shapes.output_size() : shapes.attention_size();
    if (absl::Status status = CheckReplyFloats(count); !status.ok()) return status;
    auto* tensor = response->add_outputs();
    tensor->set_name(name);
    tensor->set_datatype("FP32");
    const std::vector<int64_t>& shape = is_output ? output_shape : attention_shape;
    tensor->mutable_shape()->Assign(shape.begin(), shape.end());
    std::span<float> data;
    if (decoded->raw_encoding) {
      std::string* bytes = response->add_raw_output_contents();
      bytes->resize(count * sizeof(float));  // zero-filled: padded rows stay 0
      data = {reinterpret_cast<float*>(bytes->data()), static_cast<size_t>(count)};
    } else {
      auto* values = tensor->mutable_contents()->mutable_fp32_contents();
      values->Resize(static_cast<int>(count), 0.0f);
      data = {values->mutable_data(), static_cast<size_t>(count)};
    }
    (is_output ? buffers.output : buffers.attention) = data;
  }
  if (buffers.output.empty()) {
    // Forward always writes the output; the caller asked only for the attention.
    decoded->output_scratch.assign(shapes.output_size(), 0.0f);
    buffers.output = decoded->output_scratch;
  }
  return buffers;
}

absl::StatusOr<uint64_t> ParseModelVersion(absl::string_view version) {
  uint64_t number = 0;
  if (version.empty()) return number;
  const bool digits =
      std::all_of(version.begin(), version.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (!digits || !absl::SimpleAtoi(version, &number) || number == 0) {
    return absl::NotFoundError(absl::StrCat("model version '", Clipped(version),
                                            "' is not served: versions are positive integers"));
  }
  return number;
}

}  // namespace attnserve::server
