#include "server/observability/log_setup.h"

#include <chrono>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "server/observability/log_summary.h"

namespace attnserve::server {
namespace {

// Lines from gRPC and protobuf, counted per source line: one per site per 10 s at most.
LogSummarizer& LibrarySummarizer() {
  static auto* summarizer = new LogSummarizer(std::chrono::seconds(10));
  return *summarizer;
}

void LibraryLine(LogLevel level, absl::string_view library, const char* file, int line,
                 absl::string_view message) {
  if (!LogEnabled(level)) return;
  const std::string source = absl::StrCat(library, " ", file != nullptr ? file : "?", ":", line);
  LibrarySummarizer().Add(level, source, message, {{"source", source}});
}

void GrpcLine(gpr_log_func_args* args) {
  LogLevel level = LogLevel::kError;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = LogLevel::kDebug;
  if (args->severity == GPR_LOG_SEVERITY_INFO) level = LogLevel::kInfo;
  LibraryLine(level, "grpc", args->file, args->line, args->message);
}

void ProtobufLine(google::protobuf::LogLevel severity, const char* file, int line,
                  const std::string& message) {
  LogLevel level = LogLevel::kCritical;
  if (severity == google::protobuf::LOGLEVEL_INFO) level = LogLevel::kInfo;
  if (severity == google::protobuf::LOGLEVEL_WARNING) level = LogLevel::kWarn;
  if (severity == google::protobuf::LOGLEVEL_ERROR) level = LogLevel::kError;
  LibraryLine(level, "protobuf", file, line, message);
}

// gRPC formats only what its verbosity lets through: debug and trace open it up, other levels
// keep gRPC's own default (ERROR). GRPC_VERBOSITY, when set, wins.
void RouteLibraryLogs(LogLevel level) {
  gpr_set_log_function(GrpcLine);
  google::protobuf::SetLogHandler(ProtobufLine);
  if (std::getenv("GRPC_VERBOSITY") != nullptr) return;
  gpr_set_log_verbosity(level == LogLevel::kTrace   ? GPR_LOG_SEVERITY_DEBUG
                        : level == LogLevel::kDebug ? GPR_LOG_SEVERITY_INFO
                                                    : GPR_LOG_SEVERITY_ERROR);
}

}  // namespace

void InitLogging(LogLevel level, LogFormat format) {
  RouteLibraryLogs(level);
  ConfigureLogger(level, format);
}

void FlushLibraryLogs() { LibrarySummarizer().Flush(); }

}  // namespace attnserve::server
