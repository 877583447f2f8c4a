#pragma once

#include "inference/grpc_service.grpc.pb.h"
#include "server/frontends/open_streams.h"
#include "server/serving/admission.h"
#include "server/serving/sequence_table.h"
#include "server/transport/admin_auth.h"

namespace attnserve::server {

// The Open Inference Protocol (KServe v2, inference.GRPCInferenceService) on gRPC's callback
// API, beside attnserve.v1 on the same port, every method raw (we parse the bytes, so a body that
// is not the method's message gets INVALID_ARGUMENT with a message). ModelInfer's bytes go to an
// InferCall, which admission decodes only once the call may be served, exactly as Forward's; the
// liveness, readiness and metadata methods are answered at once; the repository extension's
// load and unload are answered when the registry's thread has done them. The methods convert
// and delegate.
class InferenceService final
    : public inference::GRPCInferenceService::WithRawCallbackMethod_ServerLive<
          inference::GRPCInferenceService::WithRawCallbackMethod_ServerReady<
              inference::GRPCInferenceService::WithRawCallbackMethod_ModelReady<
                  inference::GRPCInferenceService::WithRawCallbackMethod_ServerMetadata<
                      inference::GRPCInferenceService::WithRawCallbackMethod_ModelMetadata<
                          inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
                              inference::GRPCInferenceService::WithRawCallbackMethod_ModelStreamInfer<
                                  inference::GRPCInferenceService::
                                      WithRawCallbackMethod_RepositoryIndex<
                                          inference::GRPCInferenceService::
                                              WithRawCallbackMethod_RepositoryModelLoad<
                                                  inference::GRPCInferenceService::
                                                      WithRawCallbackMethod_RepositoryModelUnload<
                                                          inference::GRPCInferenceService::
                                                              Service>>>>>>>>>> {
 public:
  // `admission`, `admin` (who may load and unload) and `sequences` (sessions keyed by
  // sequence_id) outlive the service.
  InferenceService(Admission* admission, const AdminAuthorizer* admin, SequenceTable* sequences)
      : admission_(admission), admin_(admin), sequences_(sequences) {}

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) override;

  // Draining (admission no longer accepts): ends the ModelStreamInfer streams waiting for a
  // message.
  void EndIdleStreams() { streams_.EndIdle(); }

 private:
  // The model `name` at `version` ("" for the newest ready one), or NotFound.
  absl::StatusOr<ModelRegistry::Found> FindModel(const std::string& name,
                                                 const std::string& version) const;
  // NotFound unless `name` is "" or this server's repository.
  absl::Status CheckRepositoryName(const std::string& name) const;

  Admission* const admission_;
  const AdminAuthorizer* const admin_;
  SequenceTable* const sequences_;
  OpenStreams streams_;
};

// The tensor contract of `model` as ModelMetadata states it: -1 for dimensions of any size;
// `versions` are the model's ready versions.
inference::ModelMetadataResponse DescribeInferModel(const ModelSummary& model,
                                                    const std::vector<std::string>& versions);

// ModelMetadata's answer for a version `registry` found: its contract, and every ready version
// of its model. The gRPC and REST forms both write it.
inference::ModelMetadataResponse DescribeFound(const ModelRegistry& registry,
                                               const ModelRegistry::Found& found);

// The model `name` at `version` (the protocol's text; "" for the newest ready one), or
// NotFound / InvalidArgument: both protocols' one lookup.
absl::StatusOr<ModelRegistry::Found> FindInferModel(const ModelRegistry& registry,
                                                    absl::string_view name,
                                                    absl::string_view version);

}  // namespace attnserve::server
