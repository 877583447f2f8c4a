#include "server/frontends/v1/attention_service.h"

#include <string>

#include "server/frontends/raw_call.h"
#include "server/frontends/v1/decode_call.h"
#include "server/frontends/v1/forward_call.h"
#include "server/frontends/v1/forward_codec.h"

namespace attnserve::server {

grpc::ServerUnaryReactor* AttentionService::Forward(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return AdmitRawCall<ForwardCall>(admission_, context, request, response);
}

grpc::ServerUnaryReactor* AttentionService::ListModels(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return AnswerRawUnary<v1::ListModelsRequest, v1::ListModelsResponse>(
      context, request, response,
      [this](const v1::ListModelsRequest&, v1::ListModelsResponse* models) {
        // Every version calls can reach or still hold: READY and UNLOADING ones.
        for (const VersionStatus& version : admission_->registry().Statuses()) {
          if (version.handle != nullptr) *models->add_models() = DescribeVersion(version);
        }
        return absl::OkStatus();
      });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::Decode(
    grpc::CallbackServerContext* /*context*/) {
  return new DecodeCall(admission_, &streams_);
}

v1::ModelInfo DescribeVersion(const VersionStatus& version) {
  v1::ModelInfo info = DescribeModel(version.handle->summary);
  info.set_version(static_cast<uint64_t>(version.version));
  switch (version.state) {
    case VersionState::kReady:
      info.set_state(v1::MODEL_STATE_READY);
      break;
    case VersionState::kLoading:
      info.set_state(v1::MODEL_STATE_LOADING);
      break;
    case VersionState::kUnloading:
      info.set_state(v1::MODEL_STATE_UNLOADING);
      break;
    case VersionState::kUnavailable:
      info.set_state(v1::MODEL_STATE_UNAVAILABLE);
      break;
  }
  return info;
}

v1::ModelInfo DescribeModel(const ModelSummary& model) {
  v1::ModelInfo info;
  info.set_name(model.name);
  info.set_d_model(static_cast<int32_t>(model.d_model));
  info.set_d_context(static_cast<int32_t>(model.d_context));
  info.set_num_heads(static_cast<int32_t>(model.num_heads));
  info.set_head_dim(static_cast<int32_t>(model.head_dim));
  info.set_layout(model.layout);
  info.set_has_bias(model.has_bias);
  info.set_has_output_projection(model.has_output_projection);
  info.set_precision(model.precision);
  for (core::AttentionKind kind : model.kinds) info.add_kinds(KindToProto(kind));
  info.set_source(model.source);
  info.set_serves_sessions(model.serves_sessions);
  return info;
}

}  // namespace attnserve::server
