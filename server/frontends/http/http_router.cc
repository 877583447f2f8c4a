#include "server/frontends/http/http_router.h"

#include "absl/strings/str_split.h"
#include "server/frontends/http/http_status.h"

namespace attnserve::server {
namespace {

bool IsCapture(absl::string_view segment) {
  return segment.size() > 2 && segment.front() == '{' && segment.back() == '}';
}

// True when `path`'s segments match `pattern`, capturing into `params`.
bool Match(const std::vector<std::string>& pattern, absl::string_view path,
           std::map<std::string, std::string, std::less<>>* params) {
  std::vector<absl::string_view> segments = absl::StrSplit(path, '/');
  if (segments.size() != pattern.size()) return false;
  params->clear();
  for (size_t i = 0; i < segments.size(); ++i) {
    if (IsCapture(pattern[i])) {
      if (segments[i].empty()) return false;
      params->emplace(pattern[i].substr(1, pattern[i].size() - 2), std::string(segments[i]));
    } else if (segments[i] != pattern[i]) {
      return false;
    }
  }
  return true;
}

}  // namespace

void HttpRouter::Add(std::string method, absl::string_view pattern, Handler handler) {
  routes_.push_back({std::move(method), absl::StrSplit(pattern, '/'), std::move(handler)});
}

bool HttpRouter::Dispatch(HttpExchange& exchange) const {
  bool path_known = false;
  for (const Route& route : routes_) {
    if (!Match(route.segments, exchange.path(), &exchange.params)) continue;
    path_known = true;
    if (route.method != exchange.method()) continue;
    route.handler(exchange);
    return true;
  }
  const absl::Status status = path_known
                                  ? absl::UnimplementedError("method not allowed on this path")
                                  : absl::NotFoundError("no such endpoint; see GET /v2");
  exchange.Reply(path_known ? 405 : HttpStatus(status), "application/json",
                 ErrorJson(status.message()), {}, {}, /*close=*/exchange.content_length() != 0);
  return false;
}

}  // namespace attnserve::server
