#include "server/observability/logging.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace attnserve::server {
namespace {

struct LoggerState {
  std::shared_ptr<spdlog::logger> logger;
  LogFormat format = LogFormat::kText;
};

spdlog::level::level_enum ToSpdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kCritical:
      return spdlog::level::critical;
    case LogLevel::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

// JSON encoding of a string that never throws: invalid UTF-8 (a model name from a client)
// is replaced rather than aborting the line.
std::string JsonString(absl::string_view s) {
  return nlohmann::json(std::string(s))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string JsonValue(const LogField& field) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>)
          return JsonString(v);
        else
          return nlohmann::json(v).dump();
      },
      field.value);
}

std::string TextValue(const LogField& field) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          // Quoted (JSON's escapes; invalid UTF-8 replaced) unless every byte is printable ASCII
          // other than a quote or '=': a reader can split the line on spaces, and a caller's
          // bytes (a model name) cannot write control codes or broken text into it.
          const bool plain = !v.empty() && std::all_of(v.begin(), v.end(), [](char c) {
            return c > ' ' && c < 0x7f && c != '"' && c != '=';
          });
          return plain ? v : JsonString(v);
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else {
          return absl::StrCat(v);
        }
      },
      field.value);
}

// Guarded by Mutex(): tests may re-initialise while the server's threads log.
LoggerState& State() {
  static LoggerState* state = [] {
    auto* s = new LoggerState;
    s->logger = std::make_shared<spdlog::logger>("attnserve",
                                                 std::make_shared<spdlog::sinks::stderr_sink_mt>());
    s->logger->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %l %v", spdlog::pattern_time_type::utc);
    s->logger->set_level(spdlog::level::info);
    return s;
  }();
  return *state;
}

std::mutex& Mutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "trace") return LogLevel::kTrace;
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warn" || lower == "warning") return LogLevel::kWarn;
  if (lower == "error") return LogLevel::kError;
  if (lower == "critical") return LogLevel::kCritical;
  if (lower == "off") return LogLevel::kOff;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown log level '", name, "' (trace, debug, info, warn, error, critical or off)"));
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(absl::StrCat("unknown log format '", name, "' (text or json)"));
}

void ConfigureLogger(LogLevel level, LogFormat format) {
  std::lock_guard lock(Mutex());
  LoggerState& state = State();
  state.format = format;
  if (format == LogFormat::kJson) {
    // The pattern opens the object; Log() writes the members after "level".
    state.logger->set_pattern(R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l",%v})",
                              spdlog::pattern_time_type::utc);
  } else {
    state.logger->set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %l %v", spdlog::pattern_time_type::utc);
  }
  state.logger->set_level(ToSpdlog(level));
  state.logger->flush_on(spdlog::level::trace);
}

std::string Clipped(absl::string_view client_text) {
  constexpr size_t kShown = 100;
  if (client_text.size() <= kShown) return std::string(client_text);
  return absl::StrCat(client_text.substr(0, kShown), "... (", client_text.size(), " bytes)");
}

bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff && State().logger->should_log(ToSpdlog(level));
}

void Log(LogLevel level, absl::string_view message, const std::vector<LogField>& fields) {
  if (!LogEnabled(level)) return;
  std::lock_guard lock(Mutex());
  LoggerState& state = State();
  std::string line;
  if (state.format == LogFormat::kJson) {
    line = absl::StrCat("\"msg\":", JsonString(message));
    for (const LogField& f : fields) {
      absl::StrAppend(&line, ",", JsonString(f.key), ":", JsonValue(f));
    }
  } else {
    line = std::string(message);
    for (const LogField& f : fields) absl::StrAppend(&line, " ", f.key, "=", TextValue(f));
  }
  state.logger->log(ToSpdlog(level), "{}", line);
}

}  // namespace attnserve::server
