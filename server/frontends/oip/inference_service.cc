#include "server/frontends/oip/inference_service.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/frontends/oip/infer_call.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/oip/sequence_call.h"
#include "server/frontends/raw_call.h"

namespace attnserve::server {
namespace {

// The server's name, and the platform every model reports, as the protocol's metadata says.
constexpr char kServerName[] = "attnserve";
constexpr char kPlatform[] = "attnserve_onednn";

void AddTensor(
    const char* name, const char* datatype, std::initializer_list<int64_t> shape,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* tensors) {
  auto* tensor = tensors->Add();
  tensor->set_name(name);
  tensor->set_datatype(datatype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
}

// Whether the request's bytes may carry a sequence_id parameter, looked for without parsing:
// protobuf writes fields in number order, so the parameters (4) come before the tensors (5-7),
// within the first slice of any request that has them. A false positive only costs a parse.
bool MayBeSequence(const grpc::ByteBuffer& request) {
  std::vector<grpc::Slice> slices;
  if (!request.Dump(&slices).ok() || slices.empty()) return false;
  const absl::string_view first(reinterpret_cast<const char*>(slices[0].begin()),
                                slices[0].size());
  return first.substr(0, 4096).find("sequence_id") != absl::string_view::npos;
}

}  // namespace

grpc::ServerUnaryReactor* InferenceService::ServerLive(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return AnswerRawUnary<inference::ServerLiveRequest, inference::ServerLiveResponse>(
      context, request, response,
      [](const inference::ServerLiveRequest&, inference::ServerLiveResponse* live) {
        live->set_live(true);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* InferenceService::ServerReady(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return AnswerRawUnary<inference::ServerReadyRequest, inference::ServerReadyResponse>(
      context, request, response,
      [this](const inference::ServerReadyRequest&, inference::ServerReadyResponse* ready) {
        ready->set_ready(admission_->accepting());
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* InferenceService::ModelReady(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return AnswerRawUnary<inference::ModelReadyRequest, inference::ModelReadyResponse>(
      context, request, response,
      [this](const inference::ModelReadyRequest& asked, inference::ModelReadyResponse* ready) {
        absl::StatusOr<ServedModel*> model = FindModel(asked.name(), asked.version());
        if (model.ok()) ready->set_ready(admission_->accepting());
        return model.status();
      });
}

grpc::ServerUnaryReactor* InferenceService::ServerMetadata(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  return AnswerRawUnary<inference::ServerMetadataRequest, inference::ServerMetadataResponse>(
      context, request, response,
      [](const inference::ServerMetadataRequest&, inference::ServerMetadataResponse* metadata) {
        metadata->set_name(kServerName);
        metadata->set_version(ATTNSERVE_VERSION);
        // Request parameters (`kind`, `return_attention`) are the one extension the contract
        // uses.
        metadata->add_extensions("parameters");
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* InferenceService::ModelMetadata(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return AnswerRawUnary<inference::ModelMetadataRequest, inference::ModelMetadataResponse>(
      context, request, response,
      [this](const inference::ModelMetadataRequest& asked,
             inference::ModelMetadataResponse* metadata) {
        absl::StatusOr<ServedModel*> model = FindModel(asked.name(), asked.version());
        if (model.ok()) *metadata = DescribeInferModel((*model)->summary);
        return model.status();
      });
}

grpc::ServerUnaryReactor* InferenceService::ModelInfer(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  if (MayBeSequence(*request)) {
    auto parsed = std::make_unique<inference::ModelInferRequest>();
    grpc::ByteBuffer bytes(*request);
    grpc::ProtoBufferReader reader(&bytes);
    if (parsed->ParseFromZeroCopyStream(&reader)) {
      absl::StatusOr<std::optional<SequenceParams>> params = ReadSequenceParams(*parsed);
      if (!params.ok()) {
        grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
        reactor->Finish(ToGrpcStatus(params.status()));
        return reactor;
      }
      if (params->has_value()) {
        return new SequenceInferCall(admission_, sequences_, std::move(parsed), **params,
                                     response);
      }
    }
  }
  return AdmitRawCall<InferCall>(admission_, context, request, response);
}

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
InferenceService::ModelStreamInfer(grpc::CallbackServerContext* /*context*/) {
  return new StreamInferCall(admission_, sequences_);
}

absl::StatusOr<ServedModel*> InferenceService::FindModel(const std::string& name,
                                                         const std::string& version) const {
  if (absl::Status status = CheckModelVersion(version); !status.ok()) return status;
  return admission_->registry().Find(name);
}

inference::ModelMetadataResponse DescribeInferModel(const ModelSummary& model) {
  inference::ModelMetadataResponse metadata;
  metadata.set_name(model.name);
  // A std::string, not a const char*: GCC 12 warns falsely (-Wrestrict) on the latter.
  metadata.add_versions(std::string(kInferModelVersion));
  metadata.set_platform(kPlatform);
  // Padded shapes; `input` and `context` may also come packed, [T, width].
  AddTensor(kInferInput, "FP32", {-1, -1, model.d_model}, metadata.mutable_inputs());
  AddTensor(kInferLengths, "INT32", {-1}, metadata.mutable_inputs());
  AddTensor(kInferContext, "FP32", {-1, -1, model.d_context}, metadata.mutable_inputs());
  AddTensor(kInferContextLengths, "INT32", {-1}, metadata.mutable_inputs());
  AddTensor(kInferOutput, "FP32", {-1, -1, model.d_output}, metadata.mutable_outputs());
  AddTensor(kInferAttention, "FP32", {-1, model.num_heads, -1, -1}, metadata.mutable_outputs());
  return metadata;
}

}  // namespace attnserve::server
