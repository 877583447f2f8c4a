#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/base/periodic_thread.h"
#include "server/observability/logging.h"

namespace attnserve::server {

// Turns a stream of like events (refused calls, a library's repeated complaint) into few log
// lines, so a flood of bad calls cannot flood the log: per key, the first event is written at
// once and later ones are counted, then written as one line (how many, and the first of them
// as the example) once `interval` has passed since that key's last line. At most one line per
// key per interval; each event is also written at debug, as it happens.
class LogSummarizer {
 public:
  // A thread writes the counts of keys that went quiet; `interval` is also its period.
  explicit LogSummarizer(std::chrono::milliseconds interval = std::chrono::seconds(10));

  // Writes what is still counted, then stops the thread.
  ~LogSummarizer();

  LogSummarizer(const LogSummarizer&) = delete;
  LogSummarizer& operator=(const LogSummarizer&) = delete;

  // One event: `message` and `fields` as its own line would say them, counted under `key`
  // (e.g. "forward NOT_FOUND"); the key's line is written at `level`.
  void Add(LogLevel level, absl::string_view key, absl::string_view message,
           std::vector<LogField> fields);

  // Writes every count now (at shutdown: the process may exit without destructors).
  void Flush() { WriteDue(/*all=*/true); }

 private:
  struct Pending {
    LogLevel level = LogLevel::kInfo;
    std::string message;            // the first event counted since the key's last line
    std::vector<LogField> example;  // and its fields
    int64_t count = 0;
    std::chrono::steady_clock::time_point last_line;  // epoch: never written
  };

  // Writes the keys with counted events whose interval has passed (all of them if `all`).
  void WriteDue(bool all);
  void WriteLocked(Pending& pending, std::chrono::steady_clock::time_point now);

  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::map<std::string, Pending> keys_;  // guarded by mu_
  PeriodicThread flusher_;               // last: stopped before the keys go
};

}  // namespace attnserve::server
