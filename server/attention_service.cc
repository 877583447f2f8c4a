#include "server/attention_service.h"

#include <exception>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/forward_call.h"
#include "server/forward_codec.h"
#include "server/grpc_status.h"

namespace attnserve::server {
namespace {

// Bytes a reply with these shapes takes on the wire, roughly (floats plus a little framing).
int64_t ReplyBytes(const core::ForwardShapes& shapes) {
  return (shapes.output_size() + shapes.attention_size()) * 4 + 64;
}

}  // namespace

AttentionService::AttentionService(ModelRegistry* registry, int64_t max_message_bytes)
    : registry_(registry), max_message_bytes_(max_message_bytes) {}

grpc::ServerUnaryReactor* AttentionService::Forward(grpc::CallbackServerContext* context,
                                                    const v1::ForwardRequest* request,
                                                    v1::ForwardResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Nothing may escape into gRPC's thread: a throw (bad_alloc copying a huge misaligned
  // tensor) before the call is handed off is answered here.
  try {
    absl::Status status = Accept(context, reactor, request, response);
    if (!status.ok()) FinishRefused(reactor, status, *request);
  } catch (const std::exception& e) {
    FinishRefused(reactor, absl::InternalError(absl::StrCat("cannot take the call: ", e.what())),
                  *request);
  }
  return reactor;
}

absl::Status AttentionService::Accept(grpc::CallbackServerContext* context,
                                      grpc::ServerUnaryReactor* reactor,
                                      const v1::ForwardRequest* request,
                                      v1::ForwardResponse* response) {
  if (!accepting_.load()) return absl::UnavailableError("the server is shutting down");
  absl::StatusOr<ServedModel*> model = registry_->Find(request->model());
  if (!model.ok()) return model.status();
  auto call = std::make_unique<ForwardCall>(context, reactor, request, response, (*model)->name);
  if (absl::Status status = call->Decode(); !status.ok()) return status;
  if (absl::Status status = (*model)->layer->Validate(call->args()); !status.ok()) return status;
  const int64_t bytes = ReplyBytes((*model)->layer->Shapes(call->args()));
  if (bytes > max_message_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("the reply would take ", bytes,
                                                     " bytes, over the limit of ",
                                                     max_message_bytes_, " (--max-message-mib)"));
  }
  // From here the scheduler answers the call, whatever happens.
  (*model)->scheduler->Submit(std::move(call));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* AttentionService::ListModels(grpc::CallbackServerContext* context,
                                                       const v1::ListModelsRequest* /*request*/,
                                                       v1::ListModelsResponse* response) {
  for (const auto& model : registry_->models()) {
    *response->add_models() = DescribeModel(*model);
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
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
  for (core::AttentionKind kind :
       {core::AttentionKind::kBidirectional, core::AttentionKind::kCausal,
        core::AttentionKind::kCross, core::AttentionKind::kCausalCross}) {
    if (core::IsCross(kind) || spec.serves_self_attention()) info.add_kinds(KindToProto(kind));
  }
  info.set_source(model.source);
  return info;
}

}  // namespace attnserve::server
