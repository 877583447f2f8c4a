#include "tests/server/scrape.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/http_connection.h"
#include "client/metrics_scrape.h"

namespace attnserve::server::testing {

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  return client::HttpGet(absl::StrCat("http://127.0.0.1:", port, path), absl::Seconds(10));
}

std::string SeriesKey(const std::string& name, SeriesLabels labels) {
  if (labels.empty()) return name;
  std::sort(labels.begin(), labels.end());
  std::vector<std::string> parts;
  for (const auto& [key, value] : labels) parts.push_back(absl::StrCat(key, "=\"", value, "\""));
  return absl::StrCat(name, "{", absl::StrJoin(parts, ","), "}");
}

absl::StatusOr<std::map<std::string, double>> ParseExposition(const std::string& text) {
  // The load tester's parser (client/metrics_scrape.h), keyed the way tests look series up.
  absl::StatusOr<std::vector<client::MetricSample>> parsed = client::ParsePrometheusText(text);
  if (!parsed.ok()) return parsed.status();
  std::map<std::string, double> samples;
  for (const client::MetricSample& sample : *parsed) {
    samples[SeriesKey(sample.name, SeriesLabels(sample.labels.begin(), sample.labels.end()))] =
        sample.value;
  }
  return samples;
}

absl::StatusOr<std::map<std::string, double>> Scrape(int port) {
  absl::StatusOr<std::string> body = HttpGet(port, "/metrics");
  if (!body.ok()) return body.status();
  return ParseExposition(*body);
}

}  // namespace attnserve::server::testing
