#include "client/metrics_scrape.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/http_connection.h"

namespace attnserve::client {
namespace {

// Reads a label set {a="x",b="y"}; `text` starts after '{' and is left after '}'.
absl::Status ParseLabels(absl::string_view& text, std::map<std::string, std::string>& labels) {
  while (true) {
    text = absl::StripLeadingAsciiWhitespace(text);
    if (absl::ConsumePrefix(&text, "}")) return absl::OkStatus();
    const size_t eq = text.find('=');
    if (eq == absl::string_view::npos || text.size() < eq + 2 || text[eq + 1] != '"') {
      return absl::InvalidArgumentError("bad label");
    }
    std::string name(absl::StripAsciiWhitespace(text.substr(0, eq)));
    text.remove_prefix(eq + 2);
    std::string value;
    while (!text.empty() && text[0] != '"') {
      if (text[0] == '\\' && text.size() > 1) {
        value += text[1] == 'n' ? '\n' : text[1];
        text.remove_prefix(2);
      } else {
        value += text[0];
        text.remove_prefix(1);
      }
    }
    if (!absl::ConsumePrefix(&text, "\"")) return absl::InvalidArgumentError("unterminated label");
    labels[name] = std::move(value);
    text = absl::StripLeadingAsciiWhitespace(text);
    absl::ConsumePrefix(&text, ",");
  }
}

bool ParseValue(absl::string_view text, double& value) {
  if (text == "+Inf" || text == "Inf")
    value = std::numeric_limits<double>::infinity();
  else if (text == "-Inf")
    value = -std::numeric_limits<double>::infinity();
  else if (text == "NaN")
    value = std::numeric_limits<double>::quiet_NaN();
  else
    return absl::SimpleAtod(text, &value);
  return true;
}

bool Matches(const MetricSample& s, const std::string& name, const std::string& model) {
  if (s.name != name) return false;
  if (model.empty()) return true;
  auto it = s.labels.find("model");
  return it != s.labels.end() && it->second == model;
}

// Sum of the matching samples' values in `after` minus in `before`.
double Delta(const std::vector<MetricSample>& before, const std::vector<MetricSample>& after,
             const std::string& name, const std::string& model, bool& found) {
  double sum = 0;
  for (const MetricSample& s : after) {
    if (Matches(s, name, model)) sum += s.value, found = true;
  }
  for (const MetricSample& s : before) {
    if (Matches(s, name, model)) sum -= s.value;
  }
  return sum;
}

// A histogram's difference: mean from _sum/_count, quantiles from the cumulative buckets.
ServerDuration DiffHistogram(const std::vector<MetricSample>& before,
                             const std::vector<MetricSample>& after, const std::string& name,
                             const std::string& model, double scale, bool& found) {
  ServerDuration d;
  d.count = Delta(before, after, name + "_count", model, found);
  const double sum = Delta(before, after, name + "_sum", model, found);
  if (d.count <= 0) return d;
  d.mean_ms = sum / d.count * scale;
  std::map<double, double> buckets;  // le -> cumulative count over the step
  auto add = [&](const std::vector<MetricSample>& samples, double sign) {
    for (const MetricSample& s : samples) {
      if (!Matches(s, name + "_bucket", model) || !s.labels.contains("le")) continue;
      double le = 0;
      if (ParseValue(s.labels.at("le"), le)) buckets[le] += sign * s.value;
    }
  };
  add(after, 1);
  add(before, -1);
  // As Prometheus's histogram_quantile: linear within the bucket holding the rank.
  auto quantile = [&](double q) {
    const double rank = q * d.count;
    double lower = 0, below = 0;
    for (const auto& [le, cumulative] : buckets) {
      if (cumulative >= rank) {
        if (std::isinf(le)) return lower;
        const double in_bucket = cumulative - below;
        return in_bucket > 0 ? lower + (le - lower) * (rank - below) / in_bucket : le;
      }
      lower = le;
      below = cumulative;
    }
    return lower;
  };
  d.p50_ms = quantile(0.5) * scale;
  d.p99_ms = quantile(0.99) * scale;
  return d;
}

}  // namespace

absl::StatusOr<std::vector<MetricSample>> ParsePrometheusText(absl::string_view text) {
  std::vector<MetricSample> samples;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    MetricSample sample;
    const size_t name_end = line.find_first_of("{ \t");
    if (name_end == 0 || name_end == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("metrics line ", number, ": no value"));
    }
    sample.name = std::string(line.substr(0, name_end));
    line.remove_prefix(name_end);
    if (absl::ConsumePrefix(&line, "{")) {
      if (absl::Status s = ParseLabels(line, sample.labels); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("metrics line ", number, ": ", s.message()));
      }
    }
    line = absl::StripLeadingAsciiWhitespace(line);
    const absl::string_view value = line.substr(0, line.find_first_of(" \t"));
    if (!ParseValue(value, sample.value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics line ", number, ": bad value '", value, "'"));
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

ServerSplit DiffServerMetrics(const std::vector<MetricSample>& before,
                              const std::vector<MetricSample>& after, const std::string& model) {
  ServerSplit split;
  bool found = false;
  split.queue = DiffHistogram(before, after, "attnserve_queue_duration_seconds", model, 1e3, found);
  split.compute =
      DiffHistogram(before, after, "attnserve_compute_duration_seconds", model, 1e3, found);
  split.batches = Delta(before, after, "attnserve_batch_calls_count", model, found);
  if (split.batches > 0) {
    split.mean_batch_calls =
        Delta(before, after, "attnserve_batch_calls_sum", model, found) / split.batches;
    const double token_batches = Delta(before, after, "attnserve_batch_tokens_count", model, found);
    if (token_batches > 0) {
      split.mean_batch_tokens =
          Delta(before, after, "attnserve_batch_tokens_sum", model, found) / token_batches;
    }
  }
  auto add = [&](const std::vector<MetricSample>& samples, double sign) {
    for (const MetricSample& s : samples) {
      if (!Matches(s, "attnserve_requests_total", model)) continue;
      auto code = s.labels.find("code");
      split.requests_by_code[code == s.labels.end() ? "" : code->second] += sign * s.value;
      found = true;
    }
  };
  add(after, 1);
  add(before, -1);
  split.found = found;
  return split;
}

absl::StatusOr<std::vector<MetricSample>> ScrapeMetrics(const std::string& url) {
  absl::StatusOr<std::string> body = HttpGet(url, absl::Seconds(5));
  if (!body.ok()) return body.status();
  return ParsePrometheusText(*body);
}

}  // namespace attnserve::client
