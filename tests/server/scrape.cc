#include "tests/server/scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/metrics_scrape.h"

namespace attnserve::server::testing {

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to port ", port));
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::InternalError("short write");
  }
  std::string response;
  char buffer[65536];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || body == std::string::npos) {
    return absl::InternalError(absl::StrCat("not an HTTP response: ", response.substr(0, 200)));
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200 ") == std::string::npos) {
    return absl::NotFoundError(status_line);
  }
  return response.substr(body + 4);
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
