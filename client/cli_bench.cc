#include <iostream>

#include "absl/strings/str_cat.h"
#include "client/bench.h"
#include "client/cli.h"
#include "nlohmann/json.hpp"

namespace attnserve::client {
namespace {

// Hard ceiling on a run, so a typo in --duration cannot load a server for days.
constexpr double kMaxDurationSeconds = 3600;

nlohmann::json ReportJson(const BenchReport& report, const CallFlags& call) {
  nlohmann::json errors = nlohmann::json::object();
  for (const auto& [code, n] : report.errors) errors[absl::StatusCodeToString(code)] = n;
  return {{"kind", call.kind},
          {"concurrency", report.concurrency},
          {"ok", report.ok},
          {"errors", errors},
          {"seconds", absl::ToDoubleSeconds(report.elapsed)},
          {"requests_per_second", report.requests_per_second()},
          {"tokens_per_second", report.tokens_per_second()},
          {"tokens_per_request", report.tokens_per_request},
          {"latency_ms",
           {{"p50", report.LatencyMs(0.5)},
            {"p90", report.LatencyMs(0.9)},
            {"p99", report.LatencyMs(0.99)},
            {"max", report.LatencyMs(1.0)}}}};
}

// The most frequent error, which the process exits with when any call failed.
absl::Status WorstError(const BenchReport& report) {
  absl::StatusCode worst = absl::StatusCode::kOk;
  int64_t most = 0;
  for (const auto& [code, n] : report.errors) {
    if (n > most) worst = code, most = n;
  }
  if (worst == absl::StatusCode::kOk) return absl::OkStatus();
  return absl::Status(
      worst, absl::StrCat(report.total() - report.ok, " of ", report.total(), " calls failed"));
}

}  // namespace

absl::Status RunBenchCommand(const ConnectionFlags& connection, const BenchFlags& flags) {
  if (flags.duration_seconds < 0 || flags.duration_seconds > kMaxDurationSeconds) {
    return absl::InvalidArgumentError(
        absl::StrCat("--duration must be in [0, ", kMaxDurationSeconds, "] seconds"));
  }
  std::unique_ptr<AttentionClient> client = ConnectFromFlags(connection);
  CallFlags call_flags = flags.call;
  if (call_flags.input.empty() && call_flags.random.empty()) call_flags.random = "8,128";
  absl::StatusOr<PreparedCall> prepared = PrepareCall(*client, call_flags);
  if (!prepared.ok()) return prepared.status();
  absl::StatusOr<v1::ForwardRequest> request = BuildRequest(prepared->call);
  if (!request.ok()) return request.status();

  BenchOptions options;
  options.concurrency = flags.concurrency;
  options.duration = absl::Seconds(flags.duration_seconds);
  options.max_requests = flags.requests;
  options.warmup_requests = flags.warmup;
  absl::StatusOr<BenchReport> report = RunBench(*client, *request, options);
  if (!report.ok()) return report.status();
  if (flags.json) {
    std::cout << ReportJson(*report, call_flags).dump(2) << "\n";
  } else {
    std::cout << FormatReport(*report);
  }
  return WorstError(*report);
}

}  // namespace attnserve::client
