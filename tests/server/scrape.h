#pragma once

// Reading /metrics in tests: the load tester's HTTP GET (client/metrics_scrape.h) over a real
// socket, and the Prometheus text format parsed into series, so tests check values by series
// name and labels.

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace attnserve::server::testing {

// GET `path` from 127.0.0.1:`port`; the body when the status is 200, else FAILED_PRECONDITION
// naming the status.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// Labels of one series, in any order.
using SeriesLabels = std::vector<std::pair<std::string, std::string>>;

// A series' key as Scrape's map holds it: `name{a="x",b="y"}`, labels sorted by name.
std::string SeriesKey(const std::string& name, SeriesLabels labels = {});

// Every sample of a text exposition, by SeriesKey. Fails on a line that is not one.
absl::StatusOr<std::map<std::string, double>> ParseExposition(const std::string& text);

// HttpGet(port, "/metrics") parsed.
absl::StatusOr<std::map<std::string, double>> Scrape(int port);

}  // namespace attnserve::server::testing
