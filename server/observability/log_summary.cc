#include "server/observability/log_summary.h"

#include <utility>

namespace attnserve::server {

LogSummarizer::LogSummarizer(std::chrono::milliseconds interval)
    : interval_(interval), flusher_(interval, [this] {
        WriteDue(/*all=*/false);
        return true;
      }) {}

LogSummarizer::~LogSummarizer() {
  flusher_.Stop();
  WriteDue(/*all=*/true);
}

void LogSummarizer::Add(LogLevel level, absl::string_view key, absl::string_view message,
                        std::vector<LogField> fields) {
  if (LogEnabled(LogLevel::kDebug)) Log(LogLevel::kDebug, message, fields);
  if (!LogEnabled(level)) return;
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mu_);
  Pending& pending = keys_[std::string(key)];
  if (pending.count++ == 0) {
    pending.level = level;
    pending.message = std::string(message);
    pending.example = std::move(fields);
  }
  if (now - pending.last_line >= interval_) WriteLocked(pending, now);
}

void LogSummarizer::WriteLocked(Pending& pending, std::chrono::steady_clock::time_point now) {
  std::vector<LogField> fields;
  fields.reserve(pending.example.size() + 2);
  fields.emplace_back("count", pending.count);
  if (pending.count > 1) {
    // The count covers the time since the key's previous line.
    fields.emplace_back("seconds", std::chrono::duration<double>(now - pending.last_line).count());
  }
  for (LogField& field : pending.example) fields.push_back(std::move(field));
  Log(pending.level, pending.message, fields);
  pending.count = 0;
  pending.example.clear();
  pending.last_line = now;
}

void LogSummarizer::WriteDue(bool all) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mu_);
  for (auto& [key, pending] : keys_) {
    if (pending.count > 0 && (all || now - pending.last_line >= interval_)) {
      WriteLocked(pending, now);
    }
  }
}

}  // namespace attnserve::server
