#pragma once

#include <atomic>
#include <cstdint>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/model_registry.h"

namespace attnserve::server {

// The wire's AttentionService on gRPC's callback API. Its methods decode, check and hand the
// call to the model's scheduler; no compute ever runs on a gRPC thread.
class AttentionService final : public v1::AttentionService::CallbackService {
 public:
  // `registry` outlives the service; replies larger than `max_message_bytes` are refused
  // before any compute.
  AttentionService(ModelRegistry* registry, int64_t max_message_bytes);

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) override;

  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;

  // From now on Forward answers UNAVAILABLE (shutdown has begun).
  void StopAccepting() { accepting_.store(false); }

 private:
  // Checks the call and hands it to its model's scheduler; an error means the caller answers.
  absl::Status Accept(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                      const v1::ForwardRequest* request, v1::ForwardResponse* response);

  ModelRegistry* const registry_;
  const int64_t max_message_bytes_;
  std::atomic<bool> accepting_{true};
};

// The ModelInfo ListModels reports for `model`.
v1::ModelInfo DescribeModel(const ServedModel& model);

}  // namespace attnserve::server
