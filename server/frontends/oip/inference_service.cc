#include "server/frontends/oip/inference_service.h"

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
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

// Whether the request has a sequence_id parameter, found without parsing it: its top-level
// fields are walked (the tensors' bytes skipped in place, not copied) and each parameter's key
// read, wherever the parameters lie and however long the fields before them.
bool HasSequenceId(const grpc::ByteBuffer& request) {
  using google::protobuf::internal::WireFormatLite;
  constexpr int kParameters = 4;  // ModelInferRequest.parameters: map<string, InferParameter>
  grpc::ByteBuffer bytes(request);
  grpc::ProtoBufferReader reader(&bytes);
  google::protobuf::io::CodedInputStream in(&reader);
  while (const uint32_t tag = in.ReadTag()) {
    if (tag != WireFormatLite::MakeTag(kParameters, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      if (!WireFormatLite::SkipField(&in, tag)) return false;
      continue;
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length)) return false;
    const auto limit = in.PushLimit(static_cast<int>(length));
    // A map entry: its key is field 1.
    while (const uint32_t entry_tag = in.ReadTag()) {
      if (entry_tag != WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
        if (!WireFormatLite::SkipField(&in, entry_tag)) return false;
        continue;
      }
      uint32_t key_length = 0;
      std::string key;
      if (!in.ReadVarint32(&key_length)) return false;
      if (key_length == sizeof(kSequenceIdParameter) - 1) {
        if (!in.ReadString(&key, static_cast<int>(key_length))) return false;
        if (key == kSequenceIdParameter) return true;
      } else if (!in.Skip(static_cast<int>(key_length))) {
        return false;
      }
    }
    in.PopLimit(limit);
  }
  return false;
}

// A repository call answered later (on the registry's thread) through `reactor`.
class LaterAnswer {
 public:
  LaterAnswer(grpc::CallbackServerContext* context, grpc::ByteBuffer* response)
      : reactor_(context->DefaultReactor()), response_(response) {}

  grpc::ServerUnaryReactor* reactor() const { return reactor_; }

  // Finishes the call with `status` and, when OK, `reply`.
  template <typename Response>
  void operator()(const absl::Status& status, const Response& reply) const {
    grpc::Status answer = ToGrpcStatus(status);
    if (status.ok()) {
      bool own_buffer = false;
      answer = grpc::SerializationTraits<Response>::Serialize(reply, response_, &own_buffer);
    }
    reactor_->Finish(answer);
  }

 private:
  grpc::ServerUnaryReactor* const reactor_;
  grpc::ByteBuffer* const response_;
};

// Parses a raw request body; MalformedBody when it is not a `Request`.
template <typename Request>
absl::Status ParseRaw(const grpc::ByteBuffer* bytes, Request* request) {
  grpc::ByteBuffer copy(*bytes);  // shares gRPC's slices; the reader needs it mutable
  grpc::ProtoBufferReader reader(&copy);
  if (request->ParseFromZeroCopyStream(&reader)) return absl::OkStatus();
  return MalformedBody(Request::descriptor()->full_name());
}

// RepositoryModelLoad's `config` parameter (a JSON string), if given; Triton's file:
// parameters (model files sent in the call) are not served.
absl::StatusOr<std::optional<std::string>> LoadConfigParameter(
    const inference::RepositoryModelLoadRequest& request) {
  std::optional<std::string> config;
  for (const auto& [key, value] : request.parameters()) {
    if (key != "config") {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", Clipped(key), "' is not served; RepositoryModelLoad takes 'config'"));
    }
    if (value.parameter_choice_case() != inference::ModelRepositoryParameter::kStringParam) {
      return absl::InvalidArgumentError("parameter 'config' must be a string_param (JSON)");
    }
    config = value.string_param();
  }
  return config;
}

const char* StateName(VersionState state) { return VersionStateName(state).data(); }

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
        absl::StatusOr<ModelRegistry::Found> model = FindModel(asked.name(), asked.version());
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
        // Request parameters (`kind`, `return_attention`) and the model repository API.
        metadata->add_extensions("parameters");
        metadata->add_extensions("model_repository");
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
        absl::StatusOr<ModelRegistry::Found> model = FindModel(asked.name(), asked.version());
        if (!model.ok()) return model.status();
        *metadata = DescribeFound(admission_->registry(), *model);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* InferenceService::ModelInfer(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  if (HasSequenceId(*request)) {
    auto parsed = std::make_unique<inference::ModelInferRequest>();
    grpc::ByteBuffer bytes(*request);
    grpc::ProtoBufferReader reader(&bytes);
    // A request naming sequence_id that does not parse is still a session's message: refused
    // as one, not queued as a call (a full queue would answer it RESOURCE_EXHAUSTED).
    absl::StatusOr<std::optional<SequenceParams>> params =
        parsed->ParseFromZeroCopyStream(&reader)
            ? ReadSequenceParams(*parsed)
            : absl::StatusOr<std::optional<SequenceParams>>(
                  MalformedBody(inference::ModelInferRequest::descriptor()->full_name()));
    if (!params.ok()) {
      admission_->SessionMessageAnswered(parsed->model_name(), params.status());
      grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
      reactor->Finish(ToGrpcStatus(params.status()));
      return reactor;
    }
    if (params->has_value()) {
      return new SequenceInferCall(admission_, sequences_, std::move(parsed), **params, response);
    }
  }
  return AdmitRawCall<InferCall>(admission_, context, request, response);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* InferenceService::ModelStreamInfer(
    grpc::CallbackServerContext* /*context*/) {
  return new StreamInferCall(admission_, sequences_, &streams_);
}

grpc::ServerUnaryReactor* InferenceService::RepositoryIndex(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return AnswerRawUnary<inference::RepositoryIndexRequest, inference::RepositoryIndexResponse>(
      context, request, response,
      [this](const inference::RepositoryIndexRequest& asked,
             inference::RepositoryIndexResponse* index) {
        if (absl::Status s = CheckRepositoryName(asked.repository_name()); !s.ok()) return s;
        for (const VersionStatus& v : admission_->registry().Statuses(/*whole_repository=*/true)) {
          if (asked.ready() && v.state != VersionState::kReady) continue;
          auto* entry = index->add_models();
          entry->set_name(v.model);
          if (v.version > 0) entry->set_version(absl::StrCat(v.version));
          entry->set_state(StateName(v.state));
          entry->set_reason(v.reason);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* InferenceService::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  const LaterAnswer answer(context, response);
  const inference::RepositoryModelLoadResponse reply;
  inference::RepositoryModelLoadRequest asked;
  absl::Status status = ParseRaw(request, &asked);
  if (status.ok()) status = admin_->Authorize(*context);
  if (status.ok()) status = CheckRepositoryName(asked.repository_name());
  absl::StatusOr<std::optional<std::string>> config = LoadConfigParameter(asked);
  if (status.ok()) status = config.status();
  if (!status.ok()) {
    answer(status, reply);
    return answer.reactor();
  }
  admission_->registry().RequestLoad(asked.model_name(), *std::move(config),
                                     [answer](const absl::Status& done) {
                                       answer(done, inference::RepositoryModelLoadResponse());
                                     });
  return answer.reactor();
}

grpc::ServerUnaryReactor* InferenceService::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
    grpc::ByteBuffer* response) {
  const LaterAnswer answer(context, response);
  inference::RepositoryModelUnloadRequest asked;
  absl::Status status = ParseRaw(request, &asked);
  if (status.ok()) status = admin_->Authorize(*context);
  if (status.ok()) status = CheckRepositoryName(asked.repository_name());
  if (!status.ok()) {
    answer(status, inference::RepositoryModelUnloadResponse());
    return answer.reactor();
  }
  // Triton's unload_dependents parameter means nothing here (no ensembles); it is accepted.
  admission_->registry().RequestUnload(asked.model_name(), [answer](const absl::Status& done) {
    answer(done, inference::RepositoryModelUnloadResponse());
  });
  return answer.reactor();
}

absl::Status InferenceService::CheckRepositoryName(const std::string& name) const {
  const std::string& repository = admission_->registry().repository();
  if (name.empty() || name == repository ||
      name == std::filesystem::path(repository).filename().string()) {
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("no repository '", Clipped(name),
                                          "'; this server has one (--model-repository): send "
                                          "repository_name empty"));
}

absl::StatusOr<ModelRegistry::Found> InferenceService::FindModel(const std::string& name,
                                                                 const std::string& version) const {
  return FindInferModel(admission_->registry(), name, version);
}

inference::ModelMetadataResponse DescribeFound(const ModelRegistry& registry,
                                               const ModelRegistry::Found& found) {
  std::vector<std::string> versions;
  for (const VersionStatus& v : registry.Statuses()) {
    if (v.model == found.model->name && v.state == VersionState::kReady) {
      versions.push_back(absl::StrCat(v.version));
    }
  }
  return DescribeInferModel(found.version->summary, versions);
}

absl::StatusOr<ModelRegistry::Found> FindInferModel(const ModelRegistry& registry,
                                                    absl::string_view name,
                                                    absl::string_view version) {
  absl::StatusOr<uint64_t> number = ParseModelVersion(version);
  if (!number.ok()) return number.status();
  return registry.Find(name, *number);
}

inference::ModelMetadataResponse DescribeInferModel(const ModelSummary& model,
                                                    const std::vector<std::string>& versions) {
  inference::ModelMetadataResponse metadata;
  metadata.set_name(model.name);
  for (const std::string& version : versions) metadata.add_versions(version);
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
