#include "server/frontends/http/repository_routes.h"

#include <future>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/frontends/http/http_status.h"
#include "simdjson.h"

namespace attnserve::server {
namespace {

constexpr char kJson[] = "application/json";

// The request's JSON body (empty when there is none), read within the body limits.
absl::StatusOr<std::string> ReadJsonBody(HttpExchange& exchange, const HttpBodyLimits& limits) {
  if (exchange.content_length() == 0) return std::string();
  HttpBody body;
  absl::Status read = exchange.ReadBody(limits, simdjson::SIMDJSON_PADDING, &body);
  if (!read.ok()) return read;
  return std::move(body.bytes);
}

// A string or bool member of the body's "parameters" object, if the body has it.
absl::StatusOr<std::optional<std::string>> ConfigParameter(const std::string& body) {
  if (body.empty()) return std::nullopt;
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (parser.parse(body).get(root) != simdjson::SUCCESS || !root.is_object()) {
    return absl::InvalidArgumentError("the body must be a JSON object");
  }
  simdjson::dom::element parameters;
  if (root["parameters"].get(parameters) != simdjson::SUCCESS) return std::nullopt;
  simdjson::dom::element config;
  if (parameters["config"].get(config) != simdjson::SUCCESS) return std::nullopt;
  std::string_view text;
  if (config.get(text) != simdjson::SUCCESS) {
    return absl::InvalidArgumentError("parameter 'config' must be a string (JSON)");
  }
  return std::string(text);
}

// Waits for a registry request's answer (made on the registry's thread).
template <typename Request>
absl::Status Await(Request request) {
  std::promise<absl::Status> answered;
  std::future<absl::Status> answer = answered.get_future();
  request([&answered](const absl::Status& status) { answered.set_value(status); });
  return answer.get();
}

// Whether the caller may load and unload; if not, answered (403) before its body is read, and
// the connection closed with the body unread, as a refused bearer token's.
bool Authorized(const AdminAuthorizer& admin, HttpExchange& exchange) {
  const std::optional<absl::string_view> header = exchange.Header("Authorization");
  const absl::Status s = admin.Authorize(exchange.peer(), header.has_value() ? &*header : nullptr);
  if (s.ok()) return true;
  ReplyError(exchange, s, /*close=*/exchange.content_length() != 0);
  return false;
}

}  // namespace

void AddRepositoryRoutes(ModelRegistry* registry, const AdminAuthorizer* admin,
                         HttpBodyLimits limits, HttpRouter* router) {
  router->Add("POST", "/v2/repository/index", [registry, limits](HttpExchange& exchange) {
    absl::StatusOr<std::string> body = ReadJsonBody(exchange, limits);
    if (!body.ok()) return ReplyError(exchange, body.status(), /*close=*/true);
    std::string json = "[";
    for (const VersionStatus& v : registry->Statuses(/*whole_repository=*/true)) {
      if (json.size() > 1) json += ",";
      json += "{\"name\":";
      AppendJsonString(v.model, &json);
      if (v.version > 0) absl::StrAppend(&json, ",\"version\":\"", v.version, "\"");
      absl::StrAppend(&json, ",\"state\":\"", VersionStateName(v.state), "\",\"reason\":");
      AppendJsonString(v.reason, &json);
      json += "}";
    }
    exchange.Reply(200, kJson, json + "]");
  });
  router->Add("POST", "/v2/repository/models/{model}/load",
              [registry, admin, limits](HttpExchange& exchange) {
                if (!Authorized(*admin, exchange)) return;
                absl::StatusOr<std::string> body = ReadJsonBody(exchange, limits);
                if (!body.ok()) return ReplyError(exchange, body.status(), /*close=*/true);
                absl::StatusOr<std::optional<std::string>> config = ConfigParameter(*body);
                if (!config.ok()) return ReplyError(exchange, config.status());
                const std::string model = exchange.params.at("model");
                const absl::Status loaded = Await(
                    [&](auto done) { registry->RequestLoad(model, *config, std::move(done)); });
                if (!loaded.ok()) return ReplyError(exchange, loaded);
                exchange.Reply(200, kJson, "{}");
              });
  router->Add("POST", "/v2/repository/models/{model}/unload",
              [registry, admin, limits](HttpExchange& exchange) {
                if (!Authorized(*admin, exchange)) return;
                absl::StatusOr<std::string> body = ReadJsonBody(exchange, limits);
                if (!body.ok()) return ReplyError(exchange, body.status(), /*close=*/true);
                const std::string model = exchange.params.at("model");
                const absl::Status unloaded =
                    Await([&](auto done) { registry->RequestUnload(model, std::move(done)); });
                if (!unloaded.ok()) return ReplyError(exchange, unloaded);
                exchange.Reply(200, kJson, "{}");
              });
}

}  // namespace attnserve::server
