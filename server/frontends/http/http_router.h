#pragma once

// The REST frontend's routing table: METHOD and a path pattern whose `{name}` segments capture
// one segment each. The Open Inference Protocol's endpoints are added by oip_routes; later
// extensions (the repository endpoints, sessions) add theirs the same way, to the same table.

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "server/frontends/http/http_exchange.h"

namespace attnserve::server {

class HttpRouter {
 public:
  using Handler = std::function<void(HttpExchange&)>;

  // Routes `method` `pattern` (e.g. "/v2/models/{model}/infer") to `handler`.
  void Add(std::string method, absl::string_view pattern, Handler handler);

  // Runs the handler of the first route matching the exchange (its captures in params), or
  // answers 404 (no such path) or 405 (the path, not that method). True when a route ran.
  bool Dispatch(HttpExchange& exchange) const;

 private:
  struct Route {
    std::string method;
    std::vector<std::string> segments;  // "{name}" captures
    Handler handler;
  };

  std::vector<Route> routes_;
};

}  // namespace attnserve::server
