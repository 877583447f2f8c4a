// attnserve: serves trained multi-head attention layers over gRPC (see README.md).

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "server/observability/log_setup.h"
#include "server/options.h"
#include "server/server.h"

namespace {

using attnserve::server::LogLevel;

constexpr char kModelHelp[] =
    "A model to serve, repeatable: NAME=PATH[:num_heads=N][:prefix=P][:precision=f32|bf16]\n"
    "  PATH       a safetensors file (a PyTorch state_dict), or 'built-in' for the demo layer\n"
    "  num_heads  for files whose __metadata__ does not say it (wins over the file)\n"
    "  prefix     strips this from tensor names, to serve one layer of a bigger model,\n"
    "             e.g. prefix=encoder.layers.0.self_attn.\n"
    "  precision  what the matmuls run in (default f32)\n"
    "Without --model (or --model-repository) the built-in demo layer is served as 'demo'.\n"
    "A --model model is version 1 and always loaded.";

// Exit status when the listener stopped accepting connections (the supervisor restarts us).
constexpr int kExitListenerLost = 3;

struct Flags {
  attnserve::server::ServerOptions options;
  std::vector<std::string> models;
  std::string log_level = "info";
  std::string log_format = "text";
  int shutdown_grace_s = 30;
  double max_connection_idle_s = 300;
  double handshake_timeout_s = 10;
  std::string model_control_mode = "none";
  double repository_poll_secs = 15;
  double heap_trim_secs = 10;
  double http_header_timeout_s = 10;
  double http_body_timeout_s = 30;
  double http_idle_timeout_s = 5;
};

void AddFlags(CLI::App& app, Flags& flags) {
  auto& o = flags.options;
  app.add_option("--listen", o.listen, "HOST:PORT to listen on; port 0 picks a free port")
      ->capture_default_str();
  app.add_option("--port-file", o.port_file,
                 "Once listening, write the bound port (a number and a newline) to this file");
  app.add_option("--metrics-listen", o.metrics_listen,
                 "HOST:PORT serving Prometheus metrics at /metrics; '' or off: none")
      ->capture_default_str();
  app.add_option("--metrics-tls", o.metrics_tls,
                 "HTTPS on --metrics-listen with --tls-cert/--tls-key: auto (whenever --tls-cert "
                 "is set: the metrics name the models and show their traffic, so a port the "
                 "main port's TLS protects does not leak them in plaintext), on, or off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--metrics-token-file", o.metrics_token_file,
                 "Tokens, one a line: every scrape needs 'Authorization: Bearer TOKEN' (else "
                 "HTTP 401); re-read when the file changes. Separate from --auth-token-file, "
                 "so a scraper's token cannot call the model");
  app.add_option("--http-listen", o.http_listen,
                 "HOST:PORT serving the Open Inference Protocol over HTTP/REST (with --listen's "
                 "TLS, tokens and limits); '' or off: none")
      ->capture_default_str();
  app.add_option("--http-max-connections", o.http_max_connections,
                 "REST connections served at once (a thread each); more wait to be accepted")
      ->capture_default_str();
  app.add_option("--http-header-timeout", flags.http_header_timeout_s,
                 "Seconds a REST request's line and headers have to arrive; also the longest "
                 "pause within its body")
      ->check(CLI::Range(0.001, 2e6))
      ->capture_default_str();
  app.add_option("--http-body-timeout", flags.http_body_timeout_s,
                 "Seconds a REST request's body has to arrive")
      ->check(CLI::Range(0.001, 2e6))
      ->capture_default_str();
  app.add_option("--http-idle-timeout", flags.http_idle_timeout_s,
                 "Seconds an idle REST keep-alive connection stays open")
      ->check(CLI::Range(0.001, 2e6))
      ->capture_default_str();
  app.add_option("--http-bodies-mib", o.http_bodies_mib,
                 "MiB of request bodies the REST port holds at once, counted as their bytes arrive "
                 "and until their answer; a body past it gets 503; at least --max-message-mib; "
                 "0 = an eighth of the memory the process may use (its cgroup's limit included)")
      ->capture_default_str();
  app.add_option("--model", flags.models, kModelHelp);
  app.add_option("--model-repository", o.model_repository,
                 "A model repository in Triton's layout: DIR/NAME/VERSION/model.safetensors and "
                 "an optional DIR/NAME/config.json (docs/model-repository.md)");
  app.add_option("--model-control-mode", flags.model_control_mode,
                 "none: load the repository at start; poll: also follow its changes every "
                 "--repository-poll-secs; explicit: load only what --load-model or "
                 "RepositoryModelLoad names")
      ->capture_default_str();
  app.add_option("--repository-poll-secs", flags.repository_poll_secs,
                 "Poll mode: seconds between scans of the repository")
      ->check(CLI::Range(0.01, 86400.0))
      ->capture_default_str();
  app.add_option("--load-model", o.load_models,
                 "Explicit mode: a repository model to load at start, repeatable; '*' for all");
  app.add_option("--admin-token-file", o.admin_token_file,
                 "Tokens, one a line, of the callers allowed the repository API (load, unload) "
                 "with 'authorization: Bearer TOKEN'; without it only loopback callers are");
  app.add_option("--threads", o.compute_threads,
                 "Compute (OpenMP) threads per forward call; 0 = every core")
      ->capture_default_str();
  app.add_option("--grpc-threads", o.grpc_threads,
                 "Cap on gRPC's own threads (resource quota); 0 = gRPC's default")
      ->capture_default_str();
  app.add_option("--max-message-mib", o.max_message_mib,
                 "Largest request or reply in MiB; larger ones get RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--heap-trim-secs", flags.heap_trim_secs,
                 "Seconds between looks at the heap: once resident memory or the heap's free "
                 "bytes have grown by 16 MiB (what a burst of large messages freed), its free "
                 "pages go back to the system; so do the KV cache's slabs idle for a whole "
                 "period. 0 = never trim the heap; empty KV slabs go back at once")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--max-queue", o.max_queue,
                 "Calls waiting per model (a sequence's requests waiting for the one before them "
                 "included); more get RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max-streams-per-connection", o.max_streams,
                 "Calls one connection may have in flight (HTTP/2 max concurrent streams); "
                 "more wait in the client instead of being sent to be refused")
      ->capture_default_str();
  app.add_option("--max-batch-tokens", o.max_batch_tokens,
                 "Dynamic batching: queued calls of the same kind are merged into one run of up "
                 "to this many tokens; 0 = no batching")
      ->capture_default_str();
  app.add_option("--max-queue-delay-us", o.max_queue_delay_us,
                 "Dynamic batching: how long the oldest queued call may wait for others to "
                 "merge with (unless --max-batch-tokens are queued sooner); 0 = run at once, "
                 "merging only calls already waiting")
      ->capture_default_str();
  app.add_option("--kv-cache-mib", o.kv_cache_mib,
                 "Decode sessions: MiB every session's KV cache may hold together; a step that "
                 "does not fit gets RESOURCE_EXHAUSTED; 0 = a quarter of the memory the "
                 "process may use (its cgroup's limit included)")
      ->capture_default_str();
  app.add_option("--max-sessions", o.max_sessions,
                 "Decode sessions open at once; another gets RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max-session-tokens", o.max_session_tokens,
                 "Tokens one sequence of a decode session may hold; a step past it gets "
                 "RESOURCE_EXHAUSTED (truncate or end the session)")
      ->capture_default_str();
  app.add_option("--kv-cache-precision", o.kv_cache_precision,
                 "Decode sessions' cache storage: auto (the model's precision), f32, or bf16 "
                 "(half the bytes a step reads, outputs within bf16 rounding)")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->capture_default_str();
  app.add_option("--session-idle-timeout", o.session_idle_timeout_s,
                 "Seconds an Open Inference Protocol sequence (sequence_id) may go without a "
                 "request before its session ends; later requests get NOT_FOUND")
      ->capture_default_str();
  app.add_option("--queue-delay-target-ms", o.queue_delay_target_ms,
                 "Overload: once every call starting a run has waited longer than this for "
                 "100 ms, calls with a deadline that would wait longer are refused at once "
                 "(RESOURCE_EXHAUSTED); calls whose deadline the queued work makes impossible "
                 "are refused (DEADLINE_EXCEEDED) whatever this is; 0 = no target")
      ->capture_default_str();
  app.add_option("--max-connection-age", o.max_connection_age_s,
                 "Seconds after which a client connection is closed (gracefully, +-10 % jitter) "
                 "so clients reconnect and re-resolve, reaching replicas added since; 0 = never")
      ->capture_default_str();
  app.add_option("--max-connection-age-grace", o.max_connection_age_grace_s,
                 "Seconds the calls on a connection closed for its age get to finish")
      ->capture_default_str();
  app.add_option(
         "--shutdown-grace", flags.shutdown_grace_s,
         "Seconds queued calls may wait to run after SIGTERM/SIGINT; those still queued then are "
         "answered UNAVAILABLE (a computation already running finishes)")
      ->capture_default_str();
  app.add_option("--tls-cert", o.tls.cert,
                 "PEM certificate chain: serve TLS on --listen (re-read when the file changes)");
  app.add_option("--tls-key", o.tls.key, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", o.tls.client_ca,
                 "PEM CA bundle: mTLS, every client must present a certificate it signed");
  app.add_option("--auth-token-file", o.auth_token_file,
                 "Tokens, one a line: every call on --listen needs 'authorization: Bearer TOKEN' "
                 "(else UNAUTHENTICATED); re-read when the file changes and on SIGHUP");
  app.add_option("--health-listen", o.health_listen,
                 "HOST:PORT of a plaintext port serving only grpc.health.v1 (for probes), with "
                 "the main port's serving status");
  app.add_option("--max-connection-idle", flags.max_connection_idle_s,
                 "Seconds a connection without calls stays open")
      ->check(CLI::Range(0.001, 2e6))
      ->capture_default_str();
  app.add_option("--handshake-timeout", flags.handshake_timeout_s,
                 "Seconds a new connection has to finish its TLS and HTTP/2 handshake")
      ->check(CLI::Range(0.001, 2e6))
      ->capture_default_str();
  app.add_option("--log-level", flags.log_level,
                 "trace, debug (one line per call), info, warn, error, critical or off")
      ->capture_default_str();
  app.add_option("--log-format", flags.log_format, "text, or json (one object per line)")
      ->capture_default_str();
}

// Blocks SIGINT, SIGTERM (shut down), SIGHUP (re-read tokens) and SIGUSR1 (the listener
// watchdog's "deaf") in this thread and every thread started after (gRPC's, OpenMP's, the
// schedulers'), so they are only ever received by sigwait, outside any signal handler.
sigset_t BlockSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  sigaddset(&signals, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// OpenMP threads that spin-wait between runs take the cores from gRPC's threads and from callers
// on the same machine while the server waits for work. libgomp reads OMP_WAIT_POLICY once, when
// it is loaded (before main), so the process re-executes itself once with the policy set,
// unless the user chose one (OMP_WAIT_POLICY or GOMP_SPINCOUNT).
void SleepWhileIdle(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr) {
    return;
  }
  setenv("OMP_WAIT_POLICY", "passive", 1);
  // The binary's own path, not /proc/self/exe, so ps and top still name the process attnserve.
  char path[4096];
  const ssize_t length = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (length <= 0) return;
  path[length] = '\0';
  execv(path, argv);
  // Not reached unless exec failed: serve anyway, spinning (slower, not wrong).
}

// Raises the soft descriptor limit to the hard one: every connection costs a descriptor, and
// a low soft limit (1024 is common) runs out long before memory or cores do.
void RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t before = limit.rlim_cur;
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) limit.rlim_cur = before;
  }
  attnserve::server::Log(LogLevel::kInfo, "descriptor limit",
                         {{"soft_before", static_cast<int64_t>(before)},
                          {"soft", static_cast<int64_t>(limit.rlim_cur)},
                          {"hard", static_cast<int64_t>(limit.rlim_max)}});
}

std::atomic<bool> listener_lost{false};

int Fail(const absl::Status& status) {
  attnserve::server::Log(LogLevel::kCritical, "attnserve cannot start",
                         {{"error", std::string(status.message())}});
  std::cerr << "attnserve: " << status.message() << std::endl;
  return 1;
}

// What the flags say beyond the options they fill directly: logging (set up here, before
// anything logs), the models and the time limits in milliseconds.
absl::Status ApplyFlags(Flags& flags) {
  absl::StatusOr<LogLevel> level = attnserve::server::ParseLogLevel(flags.log_level);
  if (!level.ok()) return level.status();
  absl::StatusOr<attnserve::server::LogFormat> format =
      attnserve::server::ParseLogFormat(flags.log_format);
  if (!format.ok()) return format.status();
  attnserve::server::InitLogging(*level, *format);
  flags.options.max_connection_idle_ms = static_cast<int>(flags.max_connection_idle_s * 1000);
  flags.options.handshake_timeout_ms = static_cast<int>(flags.handshake_timeout_s * 1000);
  absl::StatusOr<attnserve::server::ControlMode> mode =
      attnserve::server::ParseControlMode(flags.model_control_mode);
  if (!mode.ok()) return mode.status();
  flags.options.model_control_mode = *mode;
  flags.options.repository_poll_interval =
      std::chrono::milliseconds(static_cast<int64_t>(flags.repository_poll_secs * 1000));
  // (Rounded up: a value under a millisecond is refused as too short, not taken for 0, never.)
  flags.options.heap_trim_interval =
      std::chrono::milliseconds(static_cast<int64_t>(std::ceil(flags.heap_trim_secs * 1000)));
  flags.options.http_header_timeout_ms = static_cast<int>(flags.http_header_timeout_s * 1000);
  flags.options.http_body_timeout_ms = static_cast<int>(flags.http_body_timeout_s * 1000);
  flags.options.http_idle_timeout_ms = static_cast<int>(flags.http_idle_timeout_s * 1000);
  flags.options.on_listener_lost = [] {
    listener_lost.store(true);
    kill(getpid(), SIGUSR1);
  };
  for (const std::string& flag : flags.models) {
    absl::StatusOr<attnserve::server::ModelConfig> model = attnserve::server::ParseModelFlag(flag);
    if (!model.ok()) return model.status();
    flags.options.models.push_back(*std::move(model));
  }
  return absl::OkStatus();
}

// Serves until SIGTERM or SIGINT (returned), or until the listener was lost (SIGUSR1 from the
// watchdog, returned too); SIGHUP re-reads the token file.
int WaitForStop(attnserve::server::Server& server, const sigset_t& signals) {
  int signal = 0;
  while (true) {
    sigwait(&signals, &signal);
    if (signal == SIGHUP) {
      server.ReloadTokens();
    } else if (signal != SIGUSR1 || listener_lost.load()) {
      return signal;
    }
  }
}

// Drains and exits: the graceful stop after SIGTERM or SIGINT, where a second signal means
// "now"; or, with the listener lost, a drain of the connections already open and the exit code
// that tells a supervisor to restart.
[[noreturn]] void DrainAndExit(attnserve::server::Server& server, const sigset_t& signals,
                               int signal, std::chrono::seconds grace) {
  if (listener_lost.load()) {
    server.Drain(grace, std::chrono::milliseconds(0));
    std::_Exit(kExitListenerLost);
  }
  attnserve::server::Log(LogLevel::kInfo, "signal received",
                         {{"signal", signal == SIGTERM ? "SIGTERM" : "SIGINT"}});
  std::thread([signals] {
    int again = 0;
    do {
      sigwait(&signals, &again);
    } while (again == SIGHUP || again == SIGUSR1);
    attnserve::server::Log(LogLevel::kWarn, "second signal: exiting without draining");
    std::_Exit(1);
  }).detach();
  // Half a second of UNAVAILABLE for late callers, so that a call racing the signal is refused
  // by us (retryable). Then the process exits without gRPC's own shutdown: from its start until
  // a client reads its GOAWAY, gRPC cancels every new call (CANCELLED, which no retry policy
  // retries); a closed connection is UNAVAILABLE instead. Every accepted call is answered and
  // its reply flushed by now, and the log flushes each line.
  server.Drain(grace, std::chrono::milliseconds(500));
  std::_Exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  SleepWhileIdle(argv);
  // Debian's abseil is built with Mutex deadlock detection on: every lock gRPC takes then
  // updates a global lock-order graph (GraphCycles), a few percent of a decode step's CPU. The
  // sanitizer builds and the tests keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const sigset_t signals = BlockSignals();
  CLI::App app{
      "attnserve: serves the forward pass of trained multi-head attention layers "
      "over gRPC (attnserve.v1.AttentionService, the Open Inference Protocol) and HTTP/REST"};
  Flags flags;
  AddFlags(app, flags);
  CLI11_PARSE(app, argc, argv);
  flags.options.metrics_listen_given = app.count("--metrics-listen") > 0;
  flags.options.http_listen_given = app.count("--http-listen") > 0;
  if (absl::Status status = ApplyFlags(flags); !status.ok()) return Fail(status);
  RaiseDescriptorLimit();
  absl::StatusOr<std::unique_ptr<attnserve::server::Server>> server =
      attnserve::server::Server::Start(flags.options);
  if (!server.ok()) return Fail(server.status());
  const int signal = WaitForStop(**server, signals);
  DrainAndExit(**server, signals, signal, std::chrono::seconds(flags.shutdown_grace_s));
}
