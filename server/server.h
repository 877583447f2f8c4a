#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "core/runtime_info.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"
#include "server/base/periodic_thread.h"
#include "server/frontends/http/http_server.h"
#include "server/frontends/oip/inference_service.h"
#include "server/frontends/v1/attention_service.h"
#include "server/observability/metrics.h"
#include "server/options.h"
#include "server/serving/admission.h"
#include "server/serving/call_reporter.h"
#include "server/serving/model_registry.h"
#include "server/transport/admin_auth.h"
#include "server/transport/listener_watchdog.h"
#include "server/transport/token_auth.h"

namespace attnserve::server {

// The service name clients and health checks use.
inline constexpr char kServiceName[] = "attnserve.v1.AttentionService";

// The Open Inference Protocol's service, on the same port.
inline constexpr char kInferenceServiceName[] = "inference.GRPCInferenceService";

// A running attnserve: models loaded, gRPC listening, health SERVING. Used by main and, at
// localhost:0, by the service tests.
class Server {
 public:
  // Loads the models, binds, starts serving and writes the port file. Fails with the loader's
  // message when a model does not load, or Unavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);

  // Shuts down (gracefully) if that has not happened yet.
  ~Server();

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The port bound (the chosen one when the options asked for port 0).
  int port() const { return port_; }

  // The port /metrics is served on; 0 when metrics are off or could not bind the default.
  int metrics_port() const { return metrics_port_; }

  // The REST port bound (--http-listen); 0 when off, or the default was busy.
  int http_port() const { return http_port_; }

  // HOST:PORT as bound.
  const std::string& address() const { return address_; }

  // The plaintext health-only port bound for --health-listen (0: none).
  int health_port() const { return health_port_; }

  // Re-reads --auth-token-file now (main calls it on SIGHUP; changes are also noticed within
  // a second without it). No-op without tokens.
  void ReloadTokens();

  // Calls accepted and not yet answered (queued or computing), over every model.
  int pending_calls() const { return registry_->pending(); }

  // The graceful stop's first half: health NOT_SERVING, new calls UNAVAILABLE, queued and
  // running calls finish; calls still queued when `grace` ends are answered UNAVAILABLE (a
  // running computation finishes). New calls keep being refused UNAVAILABLE for at least
  // `lame_duck` (clients and load balancers move away), counted from the end of the drain
  // however long it took. gRPC still runs: a process that exits now (main, after SIGTERM)
  // never has gRPC's own shutdown cut a call that arrives as CANCELLED; its connections close
  // with the process, and their callers see UNAVAILABLE. Idempotent.
  void Drain(std::chrono::milliseconds grace = std::chrono::seconds(30),
             std::chrono::milliseconds lame_duck = std::chrono::milliseconds(0));

  // Drain, then stop gRPC (replies flushed, connections closed) and the health port, which
  // answers NOT_SERVING until then: for a process that goes on (tests, embedding). Idempotent.
  void Shutdown(std::chrono::milliseconds grace = std::chrono::seconds(30),
                std::chrono::milliseconds lame_duck = std::chrono::milliseconds(0));

 private:
  Server() = default;
  // The steps of Start, in order; on failure Start stops what they started.
  absl::Status Init(const ServerOptions& options);
  absl::Status StartMainPort(const ServerOptions& options);
  void DrainLocked(std::chrono::milliseconds grace, std::chrono::milliseconds lame_duck);
  absl::Status StartHealthPort(const ServerOptions& options);
  void StartWatchers(const ServerOptions& options);
  void SetServing(bool serving);
  absl::Status StartMetrics(const ServerOptions& options);
  absl::Status StartHttpPort(const ServerOptions& options);
  void LogSummary(const ServerOptions& options, const core::RuntimeInfo& runtime) const;

  // Declared first: the schedulers and the service record into it until they are gone.
  std::unique_ptr<Metrics> metrics_;
  int metrics_port_ = 0;
  std::unique_ptr<CallReporter> reporter_;
  std::unique_ptr<SessionManager> sessions_;  // outlives the registry and every session
  std::unique_ptr<ModelRegistry> registry_;
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<AttentionService> service_;
  std::unique_ptr<SequenceTable> sequences_;          // sessions keyed by the OIP's sequence_id
  std::shared_ptr<TokenAuthenticator> auth_;          // null: no tokens asked for
  std::shared_ptr<TokenAuthenticator> admin_tokens_;  // null: no --admin-token-file
  std::unique_ptr<AdminAuthorizer> admin_;
  std::unique_ptr<InferenceService> inference_service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<grpc::CallbackGenericService> health_refusal_;
  std::unique_ptr<grpc::Server> health_server_;  // null without --health-listen
  std::unique_ptr<ListenerWatchdog> watchdog_;
  std::unique_ptr<HttpBodyBudget> http_bodies_;  // the REST port's request bodies
  std::unique_ptr<HttpServer> http_server_;      // null with --http-listen off
  int http_port_ = 0;
  int port_ = 0;
  int health_port_ = 0;
  std::string address_;
  std::mutex shutdown_mu_;
  bool drained_ = false;    // guarded by shutdown_mu_
  bool shut_down_ = false;  // guarded by shutdown_mu_
  // Polls the token file for changes until shutdown.
  std::unique_ptr<PeriodicThread> token_reloader_;
  std::unique_ptr<PeriodicThread> heap_trimmer_;
};

}  // namespace attnserve::server
