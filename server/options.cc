#include "server/options.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace attnserve::server {
namespace {

// Applies one `key=value` option; false when `part` is not an option (then it is part of PATH).
absl::StatusOr<bool> ApplyModelOption(absl::string_view part, ModelConfig* config) {
  const size_t eq = part.find('=');
  if (eq == absl::string_view::npos) return false;
  const absl::string_view key = part.substr(0, eq);
  const absl::string_view value = part.substr(eq + 1);
  if (key == "num_heads") {
    int64_t heads = 0;
    if (!absl::SimpleAtoi(value, &heads) || heads <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("num_heads must be a positive integer, got '", value, "'"));
    }
    config->load.num_heads = heads;
  } else if (key == "prefix") {
    config->load.prefix = std::string(value);
  } else if (key == "precision") {
    if (value == "f32") {
      config->precision = core::Precision::kF32;
    } else if (value == "bf16") {
      config->precision = core::Precision::kBF16;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("precision must be f32 or bf16, got '", value, "'"));
    }
  } else {
    return false;
  }
  return true;
}

bool IsHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  return colon != absl::string_view::npos && colon != 0 &&
         absl::SimpleAtoi(address.substr(colon + 1), &port) && port >= 0 && port <= 65535;
}

absl::Status CheckRepositoryOptions(const ServerOptions& options) {
  if (options.model_repository.empty() && options.model_control_mode != ControlMode::kNone) {
    return absl::InvalidArgumentError(absl::StrCat("--model-control-mode ",
                                                   ControlModeName(options.model_control_mode),
                                                   " needs --model-repository"));
  }
  if (!options.load_models.empty() && options.model_control_mode != ControlMode::kExplicit) {
    return absl::InvalidArgumentError("--load-model needs --model-control-mode explicit");
  }
  if (options.repository_poll_interval < std::chrono::milliseconds(10)) {
    return absl::InvalidArgumentError("--repository-poll-secs must be at least 0.01");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelFlag(absl::string_view flag) {
  const size_t eq = flag.find('=');
  if (eq == absl::string_view::npos || eq == 0 || eq + 1 == flag.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model '", flag, "': expected NAME=PATH[:num_heads=N][:prefix=P][:precision=f32|bf16]"));
  }
  ModelConfig config;
  config.name = std::string(flag.substr(0, eq));
  const std::vector<absl::string_view> parts = absl::StrSplit(flag.substr(eq + 1), ':');
  // Options are recognised from the end, so a PATH with ':' in it survives.
  size_t path_parts = parts.size();
  while (path_parts > 1) {
    ModelConfig trial = config;
    absl::StatusOr<bool> applied = ApplyModelOption(parts[path_parts - 1], &trial);
    if (!applied.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--model '", flag, "': ", applied.status().message()));
    }
    if (!*applied) break;
    config = std::move(trial);
    --path_parts;
  }
  std::vector<absl::string_view> path(parts.begin(), parts.begin() + path_parts);
  config.path = absl::StrJoin(path, ":");
  if (config.path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--model '", flag, "': empty PATH"));
  }
  return config;
}

absl::Status CheckOptions(const ServerOptions& options) {
  if (!IsHostPort(options.listen)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen '", options.listen, "': expected HOST:PORT (PORT 0..65535)"));
  }
  if (!options.health_listen.empty() && !IsHostPort(options.health_listen)) {
    return absl::InvalidArgumentError(absl::StrCat("--health-listen '", options.health_listen,
                                                   "': expected HOST:PORT (PORT 0..65535)"));
  }
  if (options.tls.cert.empty() != options.tls.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!options.tls.client_ca.empty() && options.tls.cert.empty()) {
    return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
  }
  if (options.max_connection_idle_ms <= 0 || options.handshake_timeout_ms <= 0 ||
      options.listener_check_ms < 0 || options.tls.refresh_seconds <= 0) {
    return absl::InvalidArgumentError(
        "connection idle and handshake bounds and the TLS refresh must be positive");
  }
  if (!MetricsOff(options.metrics_listen) && !IsHostPort(options.metrics_listen)) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics-listen '", options.metrics_listen,
                                                   "': expected HOST:PORT (PORT 0..65535) or off"));
  }
  if (options.metrics_tls != "auto" && options.metrics_tls != "on" &&
      options.metrics_tls != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-tls must be auto, on or off, got '", options.metrics_tls, "'"));
  }
  if (options.metrics_tls == "on" && options.tls.cert.empty()) {
    return absl::InvalidArgumentError("--metrics-tls on needs --tls-cert and --tls-key");
  }
  if (!HttpOff(options.http_listen) && !IsHostPort(options.http_listen)) {
    return absl::InvalidArgumentError(absl::StrCat("--http-listen '", options.http_listen,
                                                   "': expected HOST:PORT (PORT 0..65535) or off"));
  }
  if (options.http_max_connections <= 0 || options.http_max_connections > 65536 ||
      options.http_header_timeout_ms <= 0 || options.http_body_timeout_ms <= 0 ||
      options.http_idle_timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        "--http-max-connections must be in 1..65536 and the HTTP timeouts positive");
  }
  if (options.http_bodies_mib != 0 &&
      (options.http_bodies_mib < options.max_message_mib || options.http_bodies_mib > (1 << 30))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-bodies-mib must be 0 (the default) or from --max-message-mib (",
                     options.max_message_mib, ": one largest body must fit) to 2^30"));
  }
  if (options.max_message_mib <= 0 || options.max_message_mib > 2047) {
    return absl::InvalidArgumentError("--max-message-mib must be in 1..2047");
  }
  if (options.heap_trim_interval != std::chrono::milliseconds(0) &&
      (options.heap_trim_interval < std::chrono::milliseconds(10) ||
       options.heap_trim_interval > std::chrono::hours(24))) {
    return absl::InvalidArgumentError("--heap-trim-secs must be 0 (no trims) or 0.01 to 86400");
  }
  if (options.max_queue <= 0) return absl::InvalidArgumentError("--max-queue must be positive");
  if (options.max_streams <= 0) {
    return absl::InvalidArgumentError("--max-streams-per-connection must be positive");
  }
  if (options.max_batch_tokens < 0) {
    return absl::InvalidArgumentError("--max-batch-tokens must be >= 0");
  }
  if (options.session_idle_timeout_s <= 0) {
    return absl::InvalidArgumentError("--session-idle-timeout must be positive");
  }
  if (options.kv_cache_mib < 0 || options.max_sessions < 0 || options.max_session_tokens <= 0) {
    return absl::InvalidArgumentError(
        "--kv-cache-mib and --max-sessions must be >= 0, --max-session-tokens positive");
  }
  constexpr int64_t kMaxKvCacheMib = int64_t{1} << 40;  // (its bytes must fit an int64_t)
  if (options.kv_cache_mib > kMaxKvCacheMib) {
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-mib must be at most ",
                                                   kMaxKvCacheMib, ", got ", options.kv_cache_mib));
  }
  if (options.kv_cache_precision != "auto" && options.kv_cache_precision != "f32" &&
      options.kv_cache_precision != "bf16") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-cache-precision must be auto, f32 or bf16, got '", options.kv_cache_precision, "'"));
  }
  if (options.queue_delay_target_ms < 0 || options.queue_delay_target_ms > 600'000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--queue-delay-target-ms must be 0 to 600000, got ", options.queue_delay_target_ms));
  }
  if (options.max_queue_delay_us < 0 || options.max_queue_delay_us > 10'000'000) {
    return absl::InvalidArgumentError("--max-queue-delay-us must be in 0..10000000 (10 s)");
  }
  if (options.compute_threads < 0 || options.grpc_threads < 0) {
    return absl::InvalidArgumentError("--threads and --grpc-threads must be >= 0");
  }
  // gRPC takes milliseconds in an int.
  constexpr int kMaxAgeSeconds = std::numeric_limits<int>::max() / 1000;
  if (options.max_connection_age_s < 0 || options.max_connection_age_s > kMaxAgeSeconds ||
      options.max_connection_age_grace_s < 0 ||
      options.max_connection_age_grace_s > kMaxAgeSeconds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-connection-age and --max-connection-age-grace must be in 0..", kMaxAgeSeconds));
  }
  if (absl::Status status = CheckRepositoryOptions(options); !status.ok()) return status;
  std::set<std::string> names;
  for (const ModelConfig& model : options.models) {
    if (model.name.empty()) return absl::InvalidArgumentError("a model needs a name");
    if (!names.insert(model.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("model name '", model.name, "' given twice"));
    }
  }
  return absl::OkStatus();
}

namespace {

// The memory this process may use: the machine's, or its cgroup's limit when lower (v2's
// memory.max, v1's memory.limit_in_bytes).
int64_t MemoryLimitBytes() {
  int64_t limit = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    int64_t value = 0;
    if (in >> value && value > 0) limit = std::min(limit, value);
  }
  return limit;
}

}  // namespace

SessionOptions MakeSessionOptions(const ServerOptions& options) {
  SessionOptions sessions;
  sessions.kv_cache_bytes =
      options.kv_cache_mib > 0 ? options.kv_cache_mib << 20 : MemoryLimitBytes() / 4;
  // The cache's pool reserves twice its budget of address space: under a limit on that
  // (ulimit -v), the default takes an eighth of it at most.
  rlimit address_space{};
  if (options.kv_cache_mib == 0 && getrlimit(RLIMIT_AS, &address_space) == 0 &&
      address_space.rlim_cur != RLIM_INFINITY) {
    sessions.kv_cache_bytes = std::min<int64_t>(sessions.kv_cache_bytes,
                                                static_cast<int64_t>(address_space.rlim_cur / 8));
  }
  sessions.max_sessions = options.max_sessions;
  sessions.max_session_tokens = options.max_session_tokens;
  if (options.kv_cache_precision == "f32") sessions.precision = core::KvPrecision::kF32;
  if (options.kv_cache_precision == "bf16") sessions.precision = core::KvPrecision::kBF16;
  return sessions;
}

int64_t HttpBodiesBytes(const ServerOptions& options) {
  if (options.http_bodies_mib > 0) return options.http_bodies_mib << 20;
  return std::max(MemoryLimitBytes() / 8, int64_t{options.max_message_mib} << 20);
}

}  // namespace attnserve::server
