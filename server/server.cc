#include "server/server.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/runtime_info.h"
#include "grpc/grpc.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/base/heap_trimmer.h"
#include "server/frontends/http/oip_routes.h"
#include "server/frontends/http/repository_routes.h"
#include "server/observability/log_setup.h"
#include "server/observability/metrics.h"
#include "server/transport/credentials.h"
#include "server/transport/reflection.h"

namespace attnserve::server {
namespace {

constexpr std::chrono::milliseconds kFlushTime(1000);
// A probe of the listener that gRPC has not accepted by then means it no longer accepts.
constexpr std::chrono::milliseconds kListenerProbeDeadline(3000);
constexpr std::chrono::milliseconds kTokenPollInterval(1000);

// Writes the port through a temporary file and a rename, so a reader never sees half of it.
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out.good()) return absl::InternalError(absl::StrCat("cannot write --port-file ", tmp));
  }
  std::error_code error;
  std::filesystem::rename(tmp, path, error);
  if (error) {
    return absl::InternalError(
        absl::StrCat("cannot write --port-file ", path, ": ", error.message()));
  }
  return absl::OkStatus();
}

void SetHealth(grpc::Server* server, bool serving) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
  health->SetServingStatus(kInferenceServiceName, serving);
}

// Bounds that hostile or broken peers cannot stretch, on every port: a connection idle for
// too long is closed (GOAWAY), so is one that does not complete its handshake (TLS and the
// HTTP/2 settings) in time, and a peer that vanished is found by keepalive pings.
void BoundConnections(const ServerOptions& options, grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, options.max_connection_idle_ms);
  builder->AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, options.handshake_timeout_ms);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 2 * 60 * 1000);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  // Without this a second server on a busy port would bind it too (SO_REUSEPORT) and split
  // the traffic, instead of failing to start.
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

// Answers every method the health port does not serve, with a message that says why. It also
// gives that server the callback completion queue gRPC requires of every server.
class HealthOnlyRefusal final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      Refusal() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this port serves only grpc.health.v1.Health"));
      }
      void OnDone() override { delete this; }
    };
    return new Refusal;
  }
};

// A connection's calls past the stream limit wait in its client (HTTP/2 flow of streams) rather
// than crossing the wire only to be refused: under overload, refused megabytes would take the
// cores from the calls being computed. Clients re-resolve their target only when a connection
// ends: ending each one after an age lets replicas that an autoscaler adds get calls from
// clients already running.
void BoundStreamsAndAge(const ServerOptions& options, grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams);
  if (options.max_connection_age_s > 0) {
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                                options.max_connection_age_s * 1000);
    builder->AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                                options.max_connection_age_grace_s * 1000);
  }
}

// The largest request or response, in bytes (--max-message-mib).
int64_t MaxMessageBytes(const ServerOptions& options) {
  return int64_t{options.max_message_mib} << 20;
}

bool IsLoopback(const std::string& listen) {
  const std::string host = listen.substr(0, listen.rfind(':'));
  return host == "localhost" || host.starts_with("127.") || host == "[::1]" || host == "::1";
}

// The metrics port's guards: the main port's certificate (--metrics-tls) and the scrape tokens
// (--metrics-token-file). Tokens are checked by a TokenAuthenticator of their own, handed the
// Authorization header as gRPC metadata: both ports read token files and compare tokens the same
// way, and observability, below transport, only sees a callback.
absl::StatusOr<MetricsHttpOptions> MetricsHttp(const ServerOptions& options) {
  MetricsHttpOptions http;
  http.listen = options.metrics_listen;
  if (MetricsUseTls(options)) {
    http.tls_cert = options.tls.cert;
    http.tls_key = options.tls.key;
    http.tls_refresh_seconds = options.tls.refresh_seconds;
  }
  if (options.metrics_token_file.empty()) return http;
  absl::StatusOr<std::shared_ptr<TokenAuthenticator>> tokens =
      TokenAuthenticator::Load(options.metrics_token_file);
  if (!tokens.ok()) {
    // ReadTokenFile names the main port's flag in its messages.
    return absl::InvalidArgumentError(absl::StrReplaceAll(
        tokens.status().message(), {{"--auth-token-file", "--metrics-token-file"}}));
  }
  http.authorize = [tokens = *std::move(tokens)](absl::string_view authorization) {
    if (authorization.empty()) return false;
    tokens->ReloadIfChanged();  // a stat; the file is read again only when it changed
    const grpc::AuthMetadataProcessor::InputMetadata metadata = {
        {"authorization", grpc::string_ref(authorization.data(), authorization.size())}};
    grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
    return tokens->Process(metadata, /*context=*/nullptr, &consumed, &response).ok();
  };
  return http;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  if (absl::Status status = CheckOptions(options); !status.ok()) return status;
  std::unique_ptr<Server> server(new Server);
  if (absl::Status status = server->Init(options); !status.ok()) {
    // Whatever started stops: a bound port is shut down, loaded models drained.
    if (server->grpc_server_ != nullptr) {
      server->Shutdown(std::chrono::milliseconds(0));
    } else if (server->registry_ != nullptr) {
      server->registry_->Drain();
    }
    return status;
  }
  return server;
}

absl::Status Server::Init(const ServerOptions& options) {
  // The first OpenMP call starts its runtime, and LLVM's (the sanitizer builds') opens a file in
  // /dev/shm to do so: that must happen before callers can hold every descriptor, or it aborts.
  const core::RuntimeInfo runtime = core::GetRuntimeInfo();
  metrics_ = MetricsOff(options.metrics_listen) ? Metrics::Disabled() : Metrics::Create();
  reporter_ = std::make_unique<CallReporter>(metrics_.get());
  const SchedulerOptions scheduler_options{
      .max_queue = options.max_queue,
      .max_batch_tokens = options.max_batch_tokens,
      .max_queue_delay = std::chrono::microseconds(options.max_queue_delay_us),
      .queue_delay_target = std::chrono::milliseconds(options.queue_delay_target_ms)};
  const SessionOptions session_options = MakeSessionOptions(options);
  const RegistryOptions registry_options{.models = options.models,
                                         .repository = options.model_repository,
                                         .control_mode = options.model_control_mode,
                                         .poll_interval = options.repository_poll_interval,
                                         .load_models = options.load_models,
                                         .scheduler = scheduler_options,
                                         .decode_chunk_tokens = session_options.chunk_tokens,
                                         .compute_threads = options.compute_threads};
  // Before the models load: a cache that cannot have its address space stops the start at once.
  sessions_ = std::make_unique<SessionManager>(session_options);
  if (!sessions_->budget().pool().reserved()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot reserve address space for a KV cache of ",
                     session_options.kv_cache_bytes >> 20, " MiB: lower --kv-cache-mib"));
  }
  absl::StatusOr<std::unique_ptr<ModelRegistry>> registry =
      ModelRegistry::Load(registry_options, reporter_.get());
  if (!registry.ok()) return registry.status();
  registry_ = *std::move(registry);
  if (absl::Status status = StartMetrics(options); !status.ok()) return status;
  if (!options.admin_token_file.empty()) {
    absl::StatusOr<std::shared_ptr<TokenAuthenticator>> admin =
        TokenAuthenticator::Load(options.admin_token_file, "--admin-token-file");
    if (!admin.ok()) return admin.status();
    admin_tokens_ = *std::move(admin);
  }
  admin_ = std::make_unique<AdminAuthorizer>(admin_tokens_);

  metrics_->SetKvCacheLimit(session_options.kv_cache_bytes);
  sessions_->budget().pool().ObserveSlabBytes(
      [metrics = metrics_.get()](int64_t bytes) { metrics->SetKvCacheResident(bytes); });
  admission_ = std::make_unique<Admission>(registry_.get(), reporter_.get(), sessions_.get(),
                                           MaxMessageBytes(options));
  service_ = std::make_unique<AttentionService>(admission_.get());
  sequences_ = std::make_unique<SequenceTable>(
      std::chrono::milliseconds(int64_t{options.session_idle_timeout_s} * 1000));
  inference_service_ =
      std::make_unique<InferenceService>(admission_.get(), admin_.get(), sequences_.get());
  if (absl::Status status = StartMainPort(options); !status.ok()) return status;
  if (absl::Status status = StartHealthPort(options); !status.ok()) return status;
  if (absl::Status status = StartHttpPort(options); !status.ok()) return status;
  SetServing(true);
  if (!options.port_file.empty()) {
    if (absl::Status status = WritePortFile(options.port_file, port_); !status.ok()) return status;
  }
  StartWatchers(options);
  LogSummary(options, runtime);
  return absl::OkStatus();
}

absl::Status Server::StartMainPort(const ServerOptions& options) {
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::shared_ptr<TokenAuthenticator>> auth =
        TokenAuthenticator::Load(options.auth_token_file);
    if (!auth.ok()) return auth.status();
    auth_ = *std::move(auth);
    if (admin_tokens_ != nullptr) auth_->AlsoAccept(admin_tokens_);
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.tls, auth_);
  if (!credentials.ok()) return credentials.status();

  // A process-wide switch that must be set before the builder is made; reflection is chosen
  // per builder (the health port must not serve it).
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *credentials, &port_);
  builder.RegisterService(service_.get());
  builder.RegisterService(inference_service_.get());
  builder.SetOption(ReflectionOption());
  builder.SetMaxReceiveMessageSize(static_cast<int>(MaxMessageBytes(options)));
  builder.SetMaxSendMessageSize(static_cast<int>(MaxMessageBytes(options)));
  BoundConnections(options, &builder);
  BoundStreamsAndAge(options, &builder);
  if (options.grpc_threads > 0) {
    grpc::ResourceQuota quota("attnserve");
    quota.SetMaxThreads(options.grpc_threads);
    builder.SetResourceQuota(quota);
  }
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr || port_ == 0) {
    grpc_server_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  address_ = absl::StrCat(options.listen.substr(0, options.listen.rfind(':')), ":", port_);
  return absl::OkStatus();
}

absl::Status Server::StartHealthPort(const ServerOptions& options) {
  if (options.health_listen.empty()) return absl::OkStatus();
  // Only the default health service: nothing else is registered, so every other method is
  // UNIMPLEMENTED here, and no token is asked (Kubernetes' gRPC probes send none).
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(), &health_port_);
  BoundConnections(options, &builder);
  builder.SetOption(WithoutReflectionOption());
  health_refusal_ = std::make_unique<HealthOnlyRefusal>();
  builder.RegisterCallbackGenericService(health_refusal_.get());
  builder.SetMaxReceiveMessageSize(4096);
  health_server_ = builder.BuildAndStart();
  if (health_server_ == nullptr || health_port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.health_listen, " (--health-listen)"));
  }
  return absl::OkStatus();
}

absl::Status Server::StartHttpPort(const ServerOptions& options) {
  if (HttpOff(options.http_listen)) return absl::OkStatus();
  HttpRouter router;
  http_bodies_ = std::make_unique<HttpBodyBudget>(
      HttpBodiesBytes(options),
      [metrics = metrics_.get()](int64_t change) { metrics->HttpBodyBytesChanged(change); });
  metrics_->SetHttpBodyLimit(http_bodies_->limit());
  const HttpBodyLimits limits{.max_bytes = MaxMessageBytes(options),
                              .read_time = std::chrono::milliseconds(options.http_body_timeout_ms),
                              .budget = http_bodies_.get()};
  AddOipRoutes(admission_.get(), sequences_.get(), limits, &router);
  AddRepositoryRoutes(registry_.get(), admin_.get(), limits, &router);
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      HttpServer::Start({.listen = options.http_listen,
                         .tls = options.tls,
                         .auth = auth_,
                         .max_connections = options.http_max_connections,
                         .header_timeout_ms = options.http_header_timeout_ms,
                         .body_timeout_ms = options.http_body_timeout_ms,
                         .idle_timeout_ms = options.http_idle_timeout_ms},
                        std::move(router));
  if (http.ok()) {
    http_server_ = *std::move(http);
    http_port_ = http_server_->port();
  } else if (options.http_listen == kDefaultHttpListen && !options.http_listen_given &&
             http.status().code() == absl::StatusCode::kUnavailable) {
    // As for metrics: only the default may be busy (a second server on the machine).
    Log(LogLevel::kWarn, "serving without the REST port: pass --http-listen HOST:PORT (or off)",
        {{"error", std::string(http.status().message())}});
  } else {
    return http.status();
  }
  return absl::OkStatus();
}

void Server::StartWatchers(const ServerOptions& options) {
  if (auth_ != nullptr || admin_tokens_ != nullptr) {
    token_reloader_ = std::make_unique<PeriodicThread>(kTokenPollInterval, [this] {
      if (auth_ != nullptr) auth_->ReloadIfChanged();
      if (admin_tokens_ != nullptr) admin_tokens_->ReloadIfChanged();
      return true;
    });
  }
  if (options.heap_trim_interval.count() > 0) {
    // The KV cache's empty slabs stay for the sessions that come next, and go back after a
    // period or two unused, with what the heap freed.
    core::KvBlockPool& pool = sessions_->budget().pool();
    pool.KeepIdleSlabs(true);
    HeapTrimmer trimmer(HeapTrimmer::kMinGrowth, [&pool] { return pool.slab_bytes(); });
    heap_trimmer_ = std::make_unique<PeriodicThread>(
        options.heap_trim_interval, [&pool, trimmer = std::move(trimmer)]() mutable {
          if (const int64_t released = pool.ReleaseIdleSlabs(); released > 0) {
            Log(LogLevel::kDebug, "idle KV cache slabs released", {{"mib", released >> 20}});
          }
          if (std::optional<HeapTrimmer::Trim> trim = trimmer.TrimIfGrown()) {
            Log(LogLevel::kDebug, "heap trimmed",
                {{"resident_mib_before", trim->resident_before >> 20},
                 {"resident_mib_after", trim->resident_after >> 20},
                 {"ms", static_cast<int64_t>(trim->seconds * 1000)}});
          }
          return true;
        });
  }
  if (options.listener_check_ms == 0) return;
  watchdog_ = ListenerWatchdog::Start(
      port_, std::chrono::milliseconds(options.listener_check_ms), kListenerProbeDeadline,
      [this, on_lost = options.on_listener_lost] {
        SetServing(false);
        Log(LogLevel::kCritical,
            "listener no longer accepts connections (e.g. after descriptors ran out): "
            "NOT_SERVING, exiting for a restart",
            {{"address", address_}});
        if (on_lost) on_lost();
      });
}

void Server::SetServing(bool serving) {
  SetHealth(grpc_server_.get(), serving);
  SetHealth(health_server_.get(), serving);
}

void Server::ReloadTokens() {
  if (auth_ == nullptr) return;
  if (absl::Status status = auth_->Reload(); !status.ok()) {
    Log(LogLevel::kWarn, "auth tokens not reloaded; the previous ones stay in force",
        {{"error", std::string(status.message())}});
    return;
  }
  Log(LogLevel::kInfo, "auth tokens reloaded", {{"tokens", auth_->token_count()}});
}

Server::~Server() { Shutdown(); }

void Server::Drain(std::chrono::milliseconds grace, std::chrono::milliseconds lame_duck) {
  std::lock_guard lock(shutdown_mu_);
  DrainLocked(grace, lame_duck);
}

void Server::DrainLocked(std::chrono::milliseconds grace, std::chrono::milliseconds lame_duck) {
  if (drained_ || grpc_server_ == nullptr) return;
  drained_ = true;
  const auto start = std::chrono::steady_clock::now();
  Log(LogLevel::kInfo, "shutting down: draining calls", {{"address", address_}});
  // Load balancers first, so they stop sending; then refuse what still arrives. Before the
  // threads below are joined: a watchdog probe under way takes up to its deadline (3 s).
  SetServing(false);
  admission_->StopAccepting();
  // Streams waiting for their clients' next message end now, so that those clients go on
  // elsewhere at once; the others end after the answer of the message they are serving.
  service_->EndIdleStreams();
  inference_service_->EndIdleStreams();
  // REST replies from now on say Connection: close, so keep-alive clients reconnect elsewhere.
  if (http_server_ != nullptr) http_server_->CloseConnections();
  // The listener is about to close on purpose: its watchdog must not take that for deafness.
  watchdog_.reset();
  token_reloader_.reset();
  registry_->Drain(start + grace);
  // The lame duck counts from the end of the drain: however long the drain took, a call that
  // arrives now is still refused UNAVAILABLE by the service, not cut by gRPC's shutdown.
  std::this_thread::sleep_for(lame_duck);
  // main exits without destructors: what the summaries still count is written now.
  reporter_->FlushLog();
  if (http_server_ != nullptr) http_server_->FlushLog();
  FlushLibraryLogs();
  Log(LogLevel::kInfo, "drained", {{"address", address_}});
}

void Server::Shutdown(std::chrono::milliseconds grace, std::chrono::milliseconds lame_duck) {
  std::lock_guard lock(shutdown_mu_);
  if (shut_down_ || grpc_server_ == nullptr) return;
  DrainLocked(grace, lame_duck);
  shut_down_ = true;
  // Every accepted call is answered by now; gRPC only has replies to flush. It would otherwise
  // wait out the whole grace for idle client connections to close.
  grpc_server_->Shutdown(std::chrono::system_clock::now() + std::min(grace, kFlushTime));
  grpc_server_->Wait();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now());
    health_server_->Wait();
  }
  if (http_server_ != nullptr) http_server_->Stop();
  Log(LogLevel::kInfo, "stopped", {{"address", address_}});
}

absl::Status Server::StartMetrics(const ServerOptions& options) {
  if (MetricsOff(options.metrics_listen)) return absl::OkStatus();
  absl::StatusOr<MetricsHttpOptions> http = MetricsHttp(options);
  if (!http.ok()) return http.status();
  absl::StatusOr<int> port = metrics_->Serve(*http);
  if (port.ok()) {
    metrics_port_ = *port;
  } else if (options.metrics_listen == kDefaultMetricsListen && !options.metrics_listen_given &&
             port.status().code() == absl::StatusCode::kUnavailable) {
    // Only the default may be busy (a second server on the machine): serving without metrics
    // beats not serving. A port the operator named must work.
    Log(LogLevel::kWarn, "serving without metrics: pass --metrics-listen HOST:PORT (or off)",
        {{"error", std::string(port.status().message())}});
  } else {
    return port.status();
  }
  return absl::OkStatus();
}

void Server::LogSummary(const ServerOptions& options, const core::RuntimeInfo& runtime) const {
  const bool tls = !options.tls.cert.empty();
  Log(LogLevel::kInfo, "attnserve listening",
      {{"address", address_},
       {"transport", tls ? (options.tls.client_ca.empty() ? "tls" : "mtls") : "plaintext"},
       {"auth", auth_ != nullptr ? "bearer tokens" : "none"},
       {"health_port", health_port_},
       {"http_port", http_port_},
       {"metrics_port", metrics_port_},
       {"models", static_cast<int64_t>(registry_->ReadyVersions().size())},
       {"model_repository", options.model_repository},
       {"model_control_mode", std::string(ControlModeName(options.model_control_mode))},
       {"onednn", runtime.dnnl_version},
       {"isa", runtime.cpu_isa},
       {"bf16_matmul", runtime.bf16_matmul ? "onednn" : "f32 (no bf16 matmul on this CPU)"},
       {"compute_threads",
        options.compute_threads > 0 ? options.compute_threads : runtime.compute_threads},
       {"max_message_mib", options.max_message_mib},
       {"http_bodies_mib", http_bodies_ != nullptr ? http_bodies_->limit() >> 20 : 0},
       {"max_queue", options.max_queue},
       {"max_batch_tokens", options.max_batch_tokens}});
  if (!tls && !IsLoopback(options.listen)) {
    Log(LogLevel::kWarn,
        "PLAINTEXT on a non-loopback address: anyone who can reach this port can call it and "
        "read the traffic; use --tls-cert/--tls-key (and --auth-token-file) outside a trusted "
        "network",
        {{"address", address_}});
  }
  const bool metrics_tls = MetricsUseTls(options);
  const bool metrics_tokens = !options.metrics_token_file.empty();
  if (metrics_port_ != 0 && !IsLoopback(options.metrics_listen) &&
      (!metrics_tls || !metrics_tokens)) {
    Log(LogLevel::kWarn,
        absl::StrCat(metrics_tls ? "metrics without a token" : "PLAINTEXT metrics",
                     " on a non-loopback address: anyone who can reach this port reads the "
                     "models' names, shapes and traffic; use ",
                     metrics_tls ? "" : "--tls-cert/--tls-key (--metrics-tls follows them) and ",
                     "--metrics-token-file, or --metrics-listen 127.0.0.1:PORT"),
        {{"address",
          absl::StrCat(options.metrics_listen.substr(0, options.metrics_listen.rfind(':')), ":",
                       metrics_port_)},
         {"transport", metrics_tls ? "tls" : "plaintext"},
         {"auth", metrics_tokens ? "bearer tokens" : "none"}});
  }
  if (!tls && http_port_ != 0 && !IsLoopback(options.http_listen)) {
    Log(LogLevel::kWarn,
        "PLAINTEXT REST port on a non-loopback address: use --tls-cert/--tls-key (and "
        "--auth-token-file) outside a trusted network, or --http-listen off",
        {{"address", options.http_listen}, {"port", http_port_}});
  }
  for (const VersionHandle& version : registry_->ReadyVersions()) {
    std::vector<LogField> fields = SummaryFields(version->summary);
    fields.emplace_back("version", version->version);
    Log(LogLevel::kInfo, "model loaded", fields);
  }
}

}  // namespace attnserve::server
