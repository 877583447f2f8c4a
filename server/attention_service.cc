#include "server/attention_service.h"

#include <string>

#include "server/forward_call.h"
#include "server/forward_codec.h"
#include "server/raw_call.h"

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
        for (const auto& model : admission_->registry().models()) {
          *models->add_models() = DescribeModel(*model);
        }
        return absl::OkStatus();
      });
}

v1::ModelInfo DescribeModel(const ServedModel& model) {
  const core::LayerSpec& spec = model.layer->spec();
  v1::ModelInfo info;
  info.set_name(model.name);
  info.set_d_model(static_cast<int32_t>(spec.d_model));
  info.set_d_context(static_cast<int32_t>(spec.d_context));
  info.set_num_heads(static_cast<int32_t>(spec.num_heads));
  info.set_head_dim(static_cast<int32_t>(spec.head_dim));
  info.set_layout(std::string(core::LayoutName(spec.layout)));
  info.set_has_bias(spec.has_bias);
  info.set_has_output_projection(spec.has_output_projection);
  info.set_precision(std::string(core::PrecisionName(model.layer->precision())));
  for (core::AttentionKind kind : core::kAttentionKinds) {
    if (spec.Serves(kind)) info.add_kinds(KindToProto(kind));
  }
  info.set_source(model.source);
  return info;
}

}  // namespace attnserve::server
