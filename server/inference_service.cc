#include "server/inference_service.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/grpc_status.h"
#include "server/infer_call.h"
#include "server/infer_codec.h"

namespace attnserve::server {
namespace {

// The server's name, and the platform every model reports, as the protocol's metadata says.
constexpr char kServerName[] = "attnserve";
constexpr char kPlatform[] = "attnserve_onednn";

// Finishes a typed call with `status`.
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void AddTensor(
    const char* name, const char* datatype, std::initializer_list<int64_t> shape,
    google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* tensors) {
  auto* tensor = tensors->Add();
  tensor->set_name(name);
  tensor->set_datatype(datatype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
}

}  // namespace

grpc::ServerUnaryReactor* InferenceService::ServerLive(grpc::CallbackServerContext* context,
                                                       const inference::ServerLiveRequest*,
                                                       inference::ServerLiveResponse* response) {
  response->set_live(true);
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerReady(grpc::CallbackServerContext* context,
                                                        const inference::ServerReadyRequest*,
                                                        inference::ServerReadyResponse* response) {
  response->set_ready(admission_->accepting());
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelReady(grpc::CallbackServerContext* context,
                                                       const inference::ModelReadyRequest* request,
                                                       inference::ModelReadyResponse* response) {
  absl::StatusOr<ServedModel*> model = FindModel(request->name(), request->version());
  if (model.ok()) response->set_ready(admission_->accepting());
  return Answer(context, model.status());
}

grpc::ServerUnaryReactor* InferenceService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  response->set_name(kServerName);
  response->set_version(ATTNSERVE_VERSION);
  // Request parameters (`kind`, `return_attention`) are the one extension the contract uses.
  response->add_extensions("parameters");
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::StatusOr<ServedModel*> model = FindModel(request->name(), request->version());
  if (model.ok()) *response = DescribeInferModel(**model);
  return Answer(context, model.status());
}

grpc::ServerUnaryReactor* InferenceService::ModelInfer(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return AdmitRawCall<InferCall>(admission_, context, request, response);
}

absl::StatusOr<ServedModel*> InferenceService::FindModel(const std::string& name,
                                                         const std::string& version) const {
  if (!version.empty() && version != kInferModelVersion) {
    return absl::NotFoundError(absl::StrCat("model version '", version.substr(0, 64),
                                            "' is not served; every model is version ",
                                            kInferModelVersion));
  }
  return admission_->registry().Find(name);
}

inference::ModelMetadataResponse DescribeInferModel(const ServedModel& model) {
  const core::LayerSpec& spec = model.layer->spec();
  inference::ModelMetadataResponse metadata;
  metadata.set_name(model.name);
  // A std::string, not a const char*: GCC 12 warns falsely (-Wrestrict) on the latter.
  metadata.add_versions(std::string(kInferModelVersion));
  metadata.set_platform(kPlatform);
  // Padded shapes; `input` and `context` may also come packed, [T, width].
  AddTensor(kInferInput, "FP32", {-1, -1, spec.d_model}, metadata.mutable_inputs());
  AddTensor(kInferLengths, "INT32", {-1}, metadata.mutable_inputs());
  AddTensor(kInferContext, "FP32", {-1, -1, spec.d_context}, metadata.mutable_inputs());
  AddTensor(kInferContextLengths, "INT32", {-1}, metadata.mutable_inputs());
  AddTensor(kInferOutput, "FP32", {-1, -1, spec.d_output()}, metadata.mutable_outputs());
  AddTensor(kInferAttention, "FP32", {-1, spec.num_heads, -1, -1}, metadata.mutable_outputs());
  return metadata;
}

}  // namespace attnserve::server
