#include "tests/server/scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
  std::map<std::string, double> samples;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    auto bad = [&] { return absl::InvalidArgumentError(absl::StrCat("bad line: ", line)); };
    size_t pos = line.find_first_of("{ ");
    if (pos == std::string::npos) return bad();
    const std::string name = line.substr(0, pos);
    SeriesLabels labels;
    if (line[pos] == '{') {
      ++pos;
      while (line[pos] != '}') {
        const size_t eq = line.find("=\"", pos);
        if (eq == std::string::npos) return bad();
        std::string key = line.substr(pos, eq - pos);
        std::string value;
        for (pos = eq + 2; pos < line.size() && line[pos] != '"'; ++pos) {
          if (line[pos] == '\\' && pos + 1 < line.size()) {
            ++pos;
            value += line[pos] == 'n' ? '\n' : line[pos];
          } else {
            value += line[pos];
          }
        }
        if (pos >= line.size()) return bad();
        labels.emplace_back(std::move(key), std::move(value));
        ++pos;  // the closing quote
        if (line[pos] == ',') ++pos;
      }
      ++pos;  // the closing brace
    }
    std::istringstream rest(line.substr(pos));
    std::string value_text;
    rest >> value_text;
    double value = 0;
    if (!absl::SimpleAtod(value_text, &value)) return bad();
    samples[SeriesKey(name, std::move(labels))] = value;
  }
  return samples;
}

absl::StatusOr<std::map<std::string, double>> Scrape(int port) {
  absl::StatusOr<std::string> body = HttpGet(port, "/metrics");
  if (!body.ok()) return body.status();
  return ParseExposition(*body);
}

}  // namespace attnserve::server::testing
