#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/frontends/http/http_server.h"
#include "server/serving/model_config.h"
#include "server/serving/repository.h"
#include "server/serving/scheduler.h"
#include "server/serving/session.h"
#include "server/transport/credentials.h"

namespace attnserve::server {

// Where Prometheus scrapes /metrics unless --metrics-listen says otherwise (Triton's port).
inline constexpr absl::string_view kDefaultMetricsListen = "0.0.0.0:8002";

// True when `metrics_listen` turns metrics off ("" or "off").
inline bool MetricsOff(absl::string_view metrics_listen) {
  return metrics_listen.empty() || metrics_listen == "off";
}

// Where the Open Inference Protocol's REST form is served unless --http-listen says otherwise
// (Triton's and KServe's port).
inline constexpr absl::string_view kDefaultHttpListen = "0.0.0.0:8000";

// True when `http_listen` turns the REST port off ("" or "off").
inline bool HttpOff(absl::string_view http_listen) {
  return http_listen.empty() || http_listen == "off";
}

// Everything the server is configured with; main fills it from the command line.
struct ServerOptions {
  std::string listen = "0.0.0.0:50051";  // HOST:PORT; port 0 picks a free port
  std::string port_file;                 // when set, the bound port is written here
  std::vector<ModelConfig> models;       // empty (and no repository): the demo layer, "demo"
  std::string model_repository;          // DIR/NAME/VERSION/model.safetensors; "" for none
  ControlMode model_control_mode = ControlMode::kNone;
  std::chrono::milliseconds repository_poll_interval = std::chrono::seconds(15);  // poll mode
  std::vector<std::string> load_models;  // explicit mode, at start: names or "*"
  // Tokens of the callers that may use the repository API; "": loopback callers only.
  std::string admin_token_file;
  int compute_threads = 0;   // OpenMP threads per Forward; 0: every core
  int grpc_threads = 0;      // cap on gRPC's threads; 0: gRPC's default
  int max_message_mib = 64;  // largest request or response
  // How often the heap is looked at: once resident memory or its free bytes have grown, its free
  // pages go back to the system (HeapTrimmer); so do the KV cache's slabs a whole period idle.
  // 0: the heap is never trimmed, and empty KV slabs go back at once.
  std::chrono::milliseconds heap_trim_interval = std::chrono::seconds(10);
  // calls waiting per model before RESOURCE_EXHAUSTED
  int max_queue = SchedulerOptions{}.max_queue;
  int max_streams = 128;  // calls in flight per connection (HTTP/2 streams)
  // dynamic batching: token target per run; 0: none
  int64_t max_batch_tokens = SchedulerOptions{}.max_batch_tokens;
  int64_t max_queue_delay_us = 0;  // how long a call may wait for others to merge with
  // decode sessions: the KV cache budget in MiB (0: a quarter of the memory the process may
  // use, its cgroup's limit included), sessions open at once, tokens one sequence may hold, and
  // the cache's storage ("auto": the model's precision; "f32"; "bf16")
  int64_t kv_cache_mib = 0;
  int max_sessions = SessionOptions{}.max_sessions;
  int64_t max_session_tokens = SessionOptions{}.max_session_tokens;
  std::string kv_cache_precision = "auto";
  // an Open Inference Protocol sequence (sequence_id) with no request for this long ends
  int session_idle_timeout_s = 300;
  // overload: the queueing delay a model tolerates standing (CoDel's target); 0: none
  int64_t queue_delay_target_ms = SchedulerOptions{}.queue_delay_target.count();
  TlsFiles tls;                 // main port: TLS / mTLS when set
  std::string auth_token_file;  // main port: bearer tokens, one a line, when set
  std::string health_listen;    // HOST:PORT of a plaintext health-only port, when set
  // A connection with no call for this long is closed (idle or abandoned half-open peers).
  int max_connection_idle_ms = 5 * 60 * 1000;
  // A connection that has not finished its TLS handshake and HTTP/2 settings by then is closed.
  int handshake_timeout_ms = 10 * 1000;
  // How often the main listener is probed for still accepting connections; 0: never.
  int listener_check_ms = 2000;
  // Runs (on the watchdog's thread) after the listener was found deaf and health turned
  // NOT_SERVING: main exits non-zero so a supervisor restarts the process.
  std::function<void()> on_listener_lost;
  // A connection older than this is closed (GOAWAY, ±10 % jitter by gRPC) so that clients
  // reconnect and re-resolve their target: replicas added since then get a share of the calls.
  // 0: never.
  int max_connection_age_s = 300;
  // Calls still running on a connection that reached its age get this long to finish.
  int max_connection_age_grace_s = 60;
  // HOST:PORT serving /metrics; "" or "off": no metrics (kDefaultMetricsListen by default).
  std::string metrics_listen = std::string(kDefaultMetricsListen);
  // --metrics-listen was given (even as the default's value): its port must bind. Left to the
  // default, a busy port (a second server on the machine) is skipped with a warning; a value
  // set otherwise (an embedder's) must bind too.
  bool metrics_listen_given = false;
  // TLS on the metrics port with the main port's certificate: "auto" (when `tls` has one),
  // "on" (and `tls` must have one) or "off".
  std::string metrics_tls = "auto";
  // Bearer tokens a scrape must present, one a line, when set (re-read when the file changes).
  std::string metrics_token_file;
  // HOST:PORT of the REST port (the Open Inference Protocol over HTTP/1.1, with the main port's
  // TLS, tokens and --max-message-mib); "" or "off": none.
  std::string http_listen = std::string(kDefaultHttpListen);
  bool http_listen_given = false;  // as metrics_listen_given
  // REST connections served at once (one thread each); more wait in the listen queue.
  int http_max_connections = HttpServerOptions{}.max_connections;
  // A REST request's line and headers must arrive within this.
  int http_header_timeout_ms = HttpServerOptions{}.header_timeout_ms;
  // A REST request's body must arrive within this, from its first byte.
  int http_body_timeout_ms = HttpServerOptions{}.body_timeout_ms;
  // A REST keep-alive connection without a request for this long is closed.
  int http_idle_timeout_ms = HttpServerOptions{}.idle_timeout_ms;
  // MiB of request bodies the REST port holds at once (HttpBodyBudget), at least
  // --max-message-mib; 0: an eighth of the memory the process may use (at least that too).
  int64_t http_bodies_mib = 0;
};

// True when the metrics port serves TLS (--metrics-tls, given the main port's certificate).
inline bool MetricsUseTls(const ServerOptions& options) {
  return options.metrics_tls == "on" ||
         (options.metrics_tls == "auto" && !options.tls.cert.empty());
}

// Parses `NAME=PATH[:num_heads=N][:prefix=P][:precision=f32|bf16]`. PATH may itself hold ':'
// (only the trailing `:key=value` parts with known keys are options).
absl::StatusOr<ModelConfig> ParseModelFlag(absl::string_view flag);

// The decode sessions' options the server's options say: the KV cache budget (its default
// computed here), the limits and the cache precision.
SessionOptions MakeSessionOptions(const ServerOptions& options);

// The bytes of request bodies the REST port holds at once (--http-bodies-mib, its default
// computed here).
int64_t HttpBodiesBytes(const ServerOptions& options);

// Checks the options as a whole (listen address form, positive limits, unique model names).
absl::Status CheckOptions(const ServerOptions& options);

}  // namespace attnserve::server
