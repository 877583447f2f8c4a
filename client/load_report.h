#pragma once

#include <optional>
#include <string>
#include <vector>

#include "client/load_engine.h"
#include "client/metrics_scrape.h"
#include "nlohmann/json.hpp"

// The load test's outputs: the summary a person reads, JSON (stable keys), CSV (a row per
// step) and a self-contained HTML page with charts.
namespace attnserve::client {

// One measured step and, with --metrics-url, what the server saw over it.
struct LoadStep {
  StepReport report;
  std::optional<ServerSplit> server;
};

// A whole load test: one step, or a sweep's steps in order.
struct LoadRun {
  std::string sweep;  // "", "concurrency" or "rate"
  std::vector<LoadStep> steps;
  double latency_limit_ms = 0;
  bool stopped_by_latency_limit = false;
  std::string target;
  std::string protocol = "grpc";  // grpc, http-json or http-binary (bench --http)
  std::string workload;           // what was sent, in words
};

// The run as JSON: the whole run's figures at the top level, and "steps", one entry per step
// with the same keys (plus "server" with --metrics-url).
nlohmann::json RunJson(const LoadRun& run);

// One CSV row per step, after a header line.
std::string RunCsv(const LoadRun& run);

// The readable summary: a few lines for one step, a table for a sweep.
std::string RunSummary(const LoadRun& run);

// One HTML page (inline SVG and script, no network fetches) with the latency-throughput curve,
// latency over time and the histogram. When its script has drawn them, <body> gets
// data-charts-drawn="3".
std::string RunHtml(const LoadRun& run);

// The whole run merged into one report (the top level of the JSON).
StepReport MergedRun(const LoadRun& run);

}  // namespace attnserve::client
