#include "client/client.h"

#include <chrono>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_interceptor.h"

namespace attnserve::client {
namespace {

// Adds the bearer token to each call's metadata. An interceptor rather than call credentials,
// because gRPC sends call credentials over TLS only and a server may take tokens in plaintext
// (behind a TLS-terminating proxy); on the channel, so every call of every subcommand has it.
class BearerTokenInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerTokenInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class BearerTokenInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenInterceptorFactory(const std::string& token)
      : header_(absl::StrCat("Bearer ", token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new BearerTokenInterceptor(&header_);
  }

 private:
  const std::string header_;  // lives as long as the channel, which owns this factory
};

}  // namespace

const char kRetryServiceConfig[] = R"json({
  "methodConfig": [{
    "name": [{"service": "attnserve.v1.AttentionService", "method": "Forward"},
             {"service": "attnserve.v1.AttentionService", "method": "ListModels"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.1s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
})json";

absl::StatusOr<v1::ForwardRequest> BuildRequest(const ForwardRequestSpec& call) {
  v1::ForwardRequest request;
  request.set_model(call.model);
  request.set_version(call.version);
  request.set_kind(call.kind);
  if (absl::Status s = EncodeTensor(call.input, call.encoding, request.mutable_input()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("input: ", s.message()));
  }
  request.mutable_lengths()->Add(call.lengths.begin(), call.lengths.end());
  if (call.context.has_value()) {
    absl::Status s = EncodeTensor(*call.context, call.encoding, request.mutable_context());
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("context: ", s.message()));
  }
  request.mutable_context_lengths()->Add(call.context_lengths.begin(), call.context_lengths.end());
  request.set_return_attention(call.return_attention);
  return request;
}

std::unique_ptr<AttentionClient> AttentionClient::Connect(const std::string& target,
                                                          const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.load_balancing_policy.empty()) {
    args.SetLoadBalancingPolicyName(options.load_balancing_policy);
  }
  if (options.connection_index != 0) args.SetInt("attnserve.connection", options.connection_index);
  // When a server ends a connection (its --max-connection-age), the channel resolves the name
  // again; gRPC's default spaces resolutions 30 s apart, which would keep new replicas idle that
  // long after the age. A resolution is one DNS query: 2 s apart costs nothing.
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 2000);
  if (options.retry) {
    args.SetServiceConfigJSON(kRetryServiceConfig);
    // gRPC keeps a request for retrying only up to this size (256 KiB by default): past it the
    // call is committed at once and never retried, which would exempt most real calls.
    args.SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE, options.max_message_bytes);
  } else {
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_ca_pem.empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = options.tls_ca_pem;
    tls.pem_cert_chain = options.tls_cert_pem;
    tls.pem_private_key = options.tls_key_pem;
    credentials = grpc::SslCredentials(tls);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!options.token.empty()) {
    interceptors.push_back(std::make_unique<BearerTokenInterceptorFactory>(options.token));
  }
  return std::make_unique<AttentionClient>(grpc::experimental::CreateCustomChannelWithInterceptors(
                                               target, credentials, args, std::move(interceptors)),
                                           options);
}

AttentionClient::AttentionClient(std::shared_ptr<grpc::Channel> channel,
                                 const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::AttentionService::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)) {}

void AttentionClient::Prepare(grpc::ClientContext* context) const {
  if (options_.timeout != absl::InfiniteDuration()) {
    context->set_deadline(std::chrono::system_clock::now() +
                          absl::ToChronoMilliseconds(options_.timeout));
  }
}

absl::StatusOr<v1::ForwardResponse> AttentionClient::Send(const v1::ForwardRequest& request) const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ForwardResponse response;
  absl::Status status = FromGrpcStatus(stub_->Forward(&context, request, &response));
  if (!status.ok()) return status;
  return response;
}

void AttentionClient::SendAsync(grpc::ClientContext* context, const v1::ForwardRequest* request,
                                v1::ForwardResponse* response,
                                std::function<void(grpc::Status)> done) const {
  Prepare(context);
  stub_->async()->Forward(context, request, response, std::move(done));
}

void AttentionClient::StartDecode(
    grpc::ClientContext* context,
    grpc::ClientBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* reactor) const {
  stub_->async()->Decode(context, reactor);
}

absl::StatusOr<ForwardResult> AttentionClient::Forward(const ForwardRequestSpec& call) const {
  absl::StatusOr<v1::ForwardRequest> request = BuildRequest(call);
  if (!request.ok()) return request.status();
  absl::StatusOr<v1::ForwardResponse> response = Send(*request);
  if (!response.ok()) return response.status();
  ForwardResult result;
  absl::StatusOr<FloatArray> output = DecodeTensor(response->output());
  if (!output.ok())
    return absl::InternalError(absl::StrCat("response output: ", output.status().message()));
  result.output = *std::move(output);
  if (response->has_attention()) {
    absl::StatusOr<FloatArray> attention = DecodeTensor(response->attention());
    if (!attention.ok()) {
      return absl::InternalError(
          absl::StrCat("response attention: ", attention.status().message()));
    }
    result.attention = *std::move(attention);
  }
  return result;
}

absl::StatusOr<std::vector<v1::ModelInfo>> AttentionClient::ListModels() const {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ListModelsResponse response;
  absl::Status status = FromGrpcStatus(stub_->ListModels(&context, {}, &response));
  if (!status.ok()) return status;
  return std::vector<v1::ModelInfo>(response.models().begin(), response.models().end());
}

absl::StatusOr<v1::ModelInfo> AttentionClient::FindModel(const std::string& name,
                                                         uint64_t version) const {
  absl::StatusOr<std::vector<v1::ModelInfo>> models = ListModels();
  if (!models.ok()) return models.status();
  // ListModels lists each version; an empty name means the only model (of any version).
  std::set<std::string> names;
  for (const v1::ModelInfo& model : *models) names.insert(model.name());
  const std::string loaded = names.empty() ? "none" : absl::StrJoin(names, ", ");
  if (name.empty() && names.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("name a model (--model): the server has several or none: ", loaded));
  }
  const std::string wanted = name.empty() ? *names.begin() : name;
  std::optional<v1::ModelInfo> found;
  for (const v1::ModelInfo& model : *models) {
    if (model.name() != wanted || model.state() == v1::MODEL_STATE_UNLOADING) continue;
    if (version != 0 ? model.version() == version
                     : (!found.has_value() || model.version() > found->version())) {
      found = model;
    }
  }
  if (found.has_value()) return *found;
  if (names.count(wanted) > 0) {
    return absl::NotFoundError(absl::StrCat("model '", wanted, "' has no ready version ", version));
  }
  return absl::NotFoundError(absl::StrCat("no model '", name, "'; loaded: ", loaded));
}

absl::StatusOr<AttentionClient::ServingStatus> AttentionClient::Health(
    const std::string& service) const {
  grpc::ClientContext context;
  Prepare(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  absl::Status status = FromGrpcStatus(health_stub_->Check(&context, request, &response));
  if (!status.ok()) return status;
  return response.status();
}

}  // namespace attnserve::client
