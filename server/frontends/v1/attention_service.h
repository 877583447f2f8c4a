#pragma once

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/frontends/open_streams.h"
#include "server/serving/admission.h"

namespace attnserve::server {

// attnserve.v1.AttentionService on gRPC's callback API, every method raw (we parse the bytes, so
// a body that is not the method's message gets INVALID_ARGUMENT with a message). Forward's bytes
// go to a ForwardCall, which admission decodes only once the call may be served; ListModels is
// answered at once; each Decode stream is a DecodeCall, which answers a message that is not a
// DecodeRequest in the stream. Nothing here decides anything: the methods convert and delegate.
class AttentionService final
    : public v1::AttentionService::WithRawCallbackMethod_Forward<
          v1::AttentionService::WithRawCallbackMethod_ListModels<
              v1::AttentionService::WithRawCallbackMethod_Decode<v1::AttentionService::Service>>> {
 public:
  // `admission` outlives the service.
  explicit AttentionService(Admission* admission) : admission_(admission) {}

  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;

  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Decode(
      grpc::CallbackServerContext* context) override;

  // Draining (admission no longer accepts): ends the Decode streams waiting for a message.
  void EndIdleStreams() { streams_.EndIdle(); }

 private:
  Admission* const admission_;
  OpenStreams streams_;
};

// The ModelInfo ListModels reports for `model`: the one list of what a model is, which the
// start-up log and the client's table and JSON print field by field.
v1::ModelInfo DescribeModel(const ModelSummary& model);

// The same for one version of a model in `state`.
v1::ModelInfo DescribeVersion(const VersionStatus& version);

}  // namespace attnserve::server
