#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/float_array.h"
#include "client/wire.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"

namespace attnserve::client {

// How to reach the server and how long to wait for it.
struct ClientOptions {
  absl::Duration timeout = absl::Seconds(30);  // deadline of each call; InfiniteDuration: none
  int max_message_bytes = 256 << 20;           // largest response accepted (attention grows fast)
  // "round_robin" spreads calls over every address the target resolves to (a headless
  // Kubernetes Service); empty: gRPC's default, pick_first (one connection).
  std::string load_balancing_policy;
  // TLS when `tls_ca_pem` is set: the CA bundle (PEM) the server's certificate must chain to,
  // and for mTLS this client's certificate chain and key (PEM).
  std::string tls_ca_pem;
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // When set, every call on the channel carries `authorization: Bearer <token>`.
  std::string token;
  // Channels with different indexes open different connections (the load test's
  // --connections); equal ones share one, as gRPC shares a subchannel between equal channels.
  int connection_index = 0;
  // Retries Forward and ListModels on UNAVAILABLE (kRetryServiceConfig): both are pure
  // functions of their request, so a call cut off with its replica is safe to send to another.
  bool retry = true;
};

// The default service config of channels made with `retry` on: Forward and ListModels retried
// on UNAVAILABLE, up to 5 attempts, backoff 0.1 s doubling to 1 s. The README gives the same
// JSON to Python, Node and Go callers.
extern const char kRetryServiceConfig[];

// What one Forward call sends, in client terms (arrays instead of wire tensors): BuildRequest
// makes the v1::ForwardRequest of it.
struct ForwardRequestSpec {
  std::string model;     // empty: the server's only model
  uint64_t version = 0;  // 0: the newest ready version
  v1::AttentionKind kind = v1::ATTENTION_KIND_BIDIRECTIONAL;
  FloatArray input;  // [B, S, d_model] padded or [T, d_model] packed
  std::vector<int32_t> lengths;
  std::optional<FloatArray> context;  // cross kinds only
  std::vector<int32_t> context_lengths;
  Encoding encoding = Encoding::kRaw;
  bool return_attention = false;
};

// What Forward answers: the output in the input's layout, and the probabilities when asked.
struct ForwardResult {
  FloatArray output;
  std::optional<FloatArray> attention;  // [B, H, S, S_kv]
};

// Builds the wire request of a call (also used by the load test, which sends it many times).
absl::StatusOr<v1::ForwardRequest> BuildRequest(const ForwardRequestSpec& call);

// A connection to one attnserve server. Thread-safe: every method may run concurrently.
class AttentionClient {
 public:
  // What grpc.health.v1 answers: SERVING, NOT_SERVING, ...
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  // Opens a channel to `target` ("host:port"), plaintext or TLS, with the token on every call;
  // connecting happens on the first call. Every channel of the client is made here.
  static std::unique_ptr<AttentionClient> Connect(const std::string& target,
                                                  const ClientOptions& options = {});

  // Uses an existing channel (tests, custom credentials).
  AttentionClient(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);

  // Runs one attention call; server errors come back with their gRPC code.
  absl::StatusOr<ForwardResult> Forward(const ForwardRequestSpec& call) const;

  // Sends a prepared request as is: the load test's hot path, which skips re-encoding.
  absl::StatusOr<v1::ForwardResponse> Send(const v1::ForwardRequest& request) const;

  // Starts a call and returns at once (the load test's engine): `done` runs on a gRPC thread
  // when it ends. `context`, `request` and `response` must live until then.
  void SendAsync(grpc::ClientContext* context, const v1::ForwardRequest* request,
                 v1::ForwardResponse* response, std::function<void(grpc::Status)> done) const;

  // Starts a Decode stream with `reactor` (DecodeSession's): no deadline, since a session lives
  // as long as its user wants; `context` and `reactor` must live until the reactor's OnDone.
  void StartDecode(grpc::ClientContext* context,
                   grpc::ClientBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* reactor) const;

  // The options the client was made with.
  const ClientOptions& options() const { return options_; }

  // The models the server has loaded.
  absl::StatusOr<std::vector<v1::ModelInfo>> ListModels() const;

  // The model a call naming `name` at `version` would reach (empty: the only loaded model;
  // version 0: its newest ready version).
  absl::StatusOr<v1::ModelInfo> FindModel(const std::string& name, uint64_t version = 0) const;

  // grpc.health.v1 Check for `service` (empty: the whole server).
  absl::StatusOr<ServingStatus> Health(const std::string& service = "") const;

 private:
  // Applies the per-call deadline.
  void Prepare(grpc::ClientContext* context) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub_;
};

}  // namespace attnserve::client
