#include "client/metrics_scrape.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnserve::client {
namespace {

// A scrape larger than this is not attnserve's /metrics.
constexpr size_t kMaxBody = 64 << 20;

// Closes a socket when it goes out of scope.
struct SocketCloser {
  int fd;
  ~SocketCloser() {
    if (fd >= 0) close(fd);
  }
};

// Waits until `fd` is ready for `events` or the deadline passes.
bool WaitFor(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{.fd = fd, .events = events, .revents = 0};
    const int n = poll(&p, 1, static_cast<int>(left.count()));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// Connects to host:port within the deadline; the socket is non-blocking.
absl::StatusOr<int> Dial(const std::string& host, const std::string& port,
                         std::chrono::steady_clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 ||
        (errno == EINPROGRESS && WaitFor(fd, POLLOUT, deadline))) {
      int error = 0;
      socklen_t len = sizeof(error);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error == 0) {
        freeaddrinfo(found);
        return fd;
      }
      last_error = std::strerror(error);
    } else {
      last_error = errno == EINPROGRESS ? "timed out" : std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("cannot connect to ", host, ":", port, ": ", last_error));
}

// Decodes a chunked HTTP/1.1 body.
absl::StatusOr<std::string> Unchunk(absl::string_view body) {
  std::string out;
  while (true) {
    const size_t eol = body.find("\r\n");
    if (eol == absl::string_view::npos) return absl::DataLossError("truncated chunked body");
    uint64_t size = 0;
    std::string hex(absl::StripAsciiWhitespace(body.substr(0, body.find_first_of(";\r"))));
    if (!absl::SimpleHexAtoi(hex, &size)) return absl::DataLossError("bad chunk size");
    body.remove_prefix(eol + 2);
    if (size == 0) return out;
    if (body.size() < size + 2) return absl::DataLossError("truncated chunk");
    out.append(body.data(), size);
    body.remove_prefix(size + 2);
  }
}

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

// Where an http:// URL points: the host and port to dial, the Host header, the path to GET.
struct HttpUrl {
  std::string host;
  std::string port = "80";
  std::string authority;
  std::string path;
};

// Splits http://HOST[:PORT][/PATH] (HOST may be [IPv6]); nothing but plain http.
absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& url) {
  absl::string_view rest = url;
  if (!absl::ConsumePrefix(&rest, "http://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics URL '", url, "' is not http://HOST:PORT/PATH"));
  }
  const size_t slash = rest.find('/');
  const absl::string_view authority = rest.substr(0, slash);
  HttpUrl parsed;
  parsed.authority = std::string(authority);
  parsed.path = slash == absl::string_view::npos ? "/" : std::string(rest.substr(slash));
  parsed.host = std::string(authority);
  if (absl::StartsWith(authority, "[")) {  // [::1]:9090
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos)
      return absl::InvalidArgumentError("bad IPv6 address in URL");
    parsed.host = std::string(authority.substr(1, close - 1));
    if (authority.size() > close + 2) parsed.port = std::string(authority.substr(close + 2));
  } else if (const size_t colon = authority.rfind(':'); colon != absl::string_view::npos) {
    parsed.host = std::string(authority.substr(0, colon));
    parsed.port = std::string(authority.substr(colon + 1));
  }
  if (parsed.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no host in URL '", url, "'"));
  }
  return parsed;
}

// Sends all of `request` on the non-blocking socket before the deadline.
absl::Status SendAll(int fd, const std::string& request, const std::string& url,
                     std::chrono::steady_clock::time_point deadline) {
  for (size_t sent = 0; sent < request.size();) {
    if (!WaitFor(fd, POLLOUT, deadline)) return absl::DeadlineExceededError("sending to " + url);
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("sending to ", url, ": ", std::strerror(errno)));
    }
    if (n > 0) sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Reads the whole answer, until the server closes the connection (the request asked it to).
absl::StatusOr<std::string> ReadAll(int fd, const std::string& url,
                                    std::chrono::steady_clock::time_point deadline) {
  std::string response;
  char buffer[16384];
  while (true) {
    if (!WaitFor(fd, POLLIN, deadline)) return absl::DeadlineExceededError("reading " + url);
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) return response;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("reading ", url, ": ", std::strerror(errno)));
    }
    response.append(buffer, static_cast<size_t>(n));
    if (response.size() > kMaxBody) return absl::ResourceExhaustedError(url + " answers too much");
  }
}

// The body of an HTTP/1.1 answer, which must be a 200, decoded when it came chunked.
absl::StatusOr<std::string> HttpBody(const std::string& response, const std::string& url) {
  const size_t head_end = response.find("\r\n\r\n");
  if (head_end == std::string::npos) return absl::DataLossError(url + ": no HTTP header");
  const absl::string_view head(response.data(), head_end);
  std::vector<absl::string_view> status_line =
      absl::StrSplit(head.substr(0, head.find("\r\n")), ' ');
  if (status_line.size() < 2 || !absl::StartsWith(status_line[0], "HTTP/")) {
    return absl::DataLossError(url + ": not an HTTP answer");
  }
  if (status_line[1] != "200") {
    return absl::FailedPreconditionError(absl::StrCat(url, " answered HTTP ", status_line[1]));
  }
  const absl::string_view body = absl::string_view(response).substr(head_end + 4);
  if (absl::StrContains(absl::AsciiStrToLower(head), "transfer-encoding: chunked")) {
    return Unchunk(body);
  }
  return std::string(body);
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& url, absl::Duration timeout) {
  absl::StatusOr<HttpUrl> parsed = ParseHttpUrl(url);
  if (!parsed.ok()) return parsed.status();
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(timeout);
  absl::StatusOr<int> fd = Dial(parsed->host, parsed->port, deadline);
  if (!fd.ok()) return fd.status();
  SocketCloser closer{*fd};
  const std::string request =
      absl::StrCat("GET ", parsed->path, " HTTP/1.1\r\nHost: ", parsed->authority,
                   "\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
  if (absl::Status s = SendAll(*fd, request, url, deadline); !s.ok()) return s;
  absl::StatusOr<std::string> response = ReadAll(*fd, url, deadline);
  if (!response.ok()) return response.status();
  return HttpBody(*response, url);
}

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
