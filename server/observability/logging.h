#pragma once

// The server's logging, behind one small interface so that nothing else includes spdlog.
// Lines are either text (`2026-01-01T00:00:00.000Z info message key=value ...`) or one JSON
// object per line (`{"ts":...,"level":...,"msg":...,"key":value}`) for log collectors.

#include <concepts>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve::server {

// Severity, from the most verbose; kOff silences everything.
enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kCritical, kOff };

// How each line is written.
enum class LogFormat { kText, kJson };

// Parses trace, debug, info, warn, error, critical or off.
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);

// Parses text or json.
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);

// Sets the level and format of every later line of ours (to stderr). InitLogging (log_setup.h)
// also routes the libraries' lines here; this is its part that needs no summaries.
void ConfigureLogger(LogLevel level, LogFormat format);

// True when lines of `level` are written: lets callers skip building expensive fields.
bool LogEnabled(LogLevel level);

// One key and value attached to a line: `key=value` in text, a member in JSON.
struct LogField {
  LogField(absl::string_view k, absl::string_view v) : key(k), value(std::string(v)) {}
  LogField(absl::string_view k, const char* v) : key(k), value(std::string(v)) {}
  LogField(absl::string_view k, const std::string& v) : key(k), value(v) {}
  LogField(absl::string_view k, bool v) : key(k), value(v) {}
  LogField(absl::string_view k, double v) : key(k), value(v) {}
  template <std::integral T>
  LogField(absl::string_view k, T v) : key(k), value(static_cast<int64_t>(v)) {}

  std::string key;
  std::variant<std::string, int64_t, double, bool> value;
};

// Writes one line when `level` is enabled.
void Log(LogLevel level, absl::string_view message, const std::vector<LogField>& fields = {});

// A string a client sent (a model name), as messages and log lines repeat it: at most 100 bytes,
// then how long it was, so a huge one cannot swell an error's metadata or the log.
std::string Clipped(absl::string_view client_text);

}  // namespace attnserve::server
