#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

// The server's own figures for a load test: attnserve's Prometheus /metrics, scraped before
// and after a step, give its queue vs compute time and batch sizes over exactly that step.
namespace attnserve::client {

// One sample of the Prometheus text format: name{labels} value.
struct MetricSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Parses the Prometheus text exposition format (comments and TYPE lines skipped).
absl::StatusOr<std::vector<MetricSample>> ParsePrometheusText(absl::string_view text);

// A server-side duration over a step: the calls it covers, their mean and estimated quantiles.
struct ServerDuration {
  double count = 0;
  double mean_ms = 0;
  double p50_ms = 0;  // from the histogram's buckets, interpolated as Prometheus does
  double p99_ms = 0;
};

// What the server saw between two scrapes.
struct ServerSplit {
  bool found = false;  // the scrapes held attnserve's metrics
  ServerDuration queue;
  ServerDuration compute;
  double batches = 0;
  double mean_batch_calls = 0;   // calls merged per batch
  double mean_batch_tokens = 0;  // tokens per batch
  std::map<std::string, double> requests_by_code;
};

// The difference `after` - `before` of attnserve's metrics, summed over the series whose
// `model` label is `model` (every series when empty).
ServerSplit DiffServerMetrics(const std::vector<MetricSample>& before,
                              const std::vector<MetricSample>& after, const std::string& model);

// Scrapes `url` and parses it.
absl::StatusOr<std::vector<MetricSample>> ScrapeMetrics(const std::string& url);

}  // namespace attnserve::client
