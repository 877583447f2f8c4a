#pragma once

// Logging as the process sets it up: our lines and the libraries' (gRPC, protobuf) in one
// format, the libraries' summarised so they cannot flood the log. Above both logging.h and
// log_summary.h, which know nothing of each other's callers.

#include "server/observability/logging.h"

namespace attnserve::server {

// Sets the level and format of every later line (to stderr), gRPC's and protobuf's own lines
// included: those go through this logger too, summarised per source line (LogSummarizer) so a
// library complaining once per bad call cannot flood the log. Callable again, e.g. by tests.
void InitLogging(LogLevel level, LogFormat format);

// Writes the counts of gRPC's and protobuf's summarised lines not yet written (at shutdown).
void FlushLibraryLogs();

}  // namespace attnserve::server
