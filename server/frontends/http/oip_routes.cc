#include "server/frontends/http/oip_routes.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/frontends/http/http_status.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/oip/inference_service.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

constexpr char kJson[] = "application/json";

// The version segment of the path, "" when the path names none.
std::string Version(const HttpExchange& exchange) {
  const auto it = exchange.params.find("version");
  return it == exchange.params.end() ? "" : it->second;
}

absl::StatusOr<ModelRegistry::Found> FindModel(const Admission& admission,
                                               const HttpExchange& exchange) {
  return FindInferModel(admission.registry(), exchange.params.at("model"), Version(exchange));
}

void AppendTensors(const google::protobuf::RepeatedPtrField<
                       inference::ModelMetadataResponse::TensorMetadata>& tensors,
                   std::string* json) {
  *json += "[";
  for (int i = 0; i < tensors.size(); ++i) {
    if (i > 0) *json += ",";
    *json += "{\"name\":";
    AppendJsonString(tensors[i].name(), json);
    *json += ",\"datatype\":";
    AppendJsonString(tensors[i].datatype(), json);
    absl::StrAppend(json, ",\"shape\":[", absl::StrJoin(tensors[i].shape(), ","), "]}");
  }
  *json += "]";
}

// ModelMetadata's answer (DescribeInferModel: the one statement of the contract) as the REST
// form writes it.
std::string ModelMetadataJson(const inference::ModelMetadataResponse& metadata) {
  std::string json = "{\"name\":";
  AppendJsonString(metadata.name(), &json);
  json += ",\"versions\":[";
  for (int i = 0; i < metadata.versions_size(); ++i) {
    if (i > 0) json += ",";
    AppendJsonString(metadata.versions(i), &json);
  }
  json += "],\"platform\":";
  AppendJsonString(metadata.platform(), &json);
  json += ",\"inputs\":";
  AppendTensors(metadata.inputs(), &json);
  json += ",\"outputs\":";
  AppendTensors(metadata.outputs(), &json);
  json += "}";
  return json;
}

// The call's deadline from Request-Timeout-Ms (max() without it).
absl::StatusOr<Clock::time_point> Deadline(const HttpExchange& exchange, Clock::time_point now) {
  const std::optional<absl::string_view> header = exchange.Header(kRequestTimeoutHeader);
  if (!header.has_value()) return Clock::time_point::max();
  int64_t ms = 0;
  if (!absl::SimpleAtoi(*header, &ms) || ms <= 0 || ms > 365LL * 24 * 3600 * 1000) {
    return absl::InvalidArgumentError(
        absl::StrCat(kRequestTimeoutHeader, " must be a positive number of milliseconds, got '",
                     Clipped(*header), "'"));
  }
  return now + std::chrono::milliseconds(ms);
}

void Infer(Admission& admission, const HttpBodyLimits& limits, HttpExchange& exchange) {
  const Clock::time_point arrival = Clock::now();
  absl::StatusOr<Clock::time_point> deadline = Deadline(exchange, arrival);
  if (!deadline.ok()) return ReplyError(exchange, deadline.status(), /*close=*/true);
  if (exchange.content_length() > limits.max_bytes) {
    // Refused before a byte of it is read, and the connection closed rather than drained.
    return ReplyError(exchange,
                      TooLarge(absl::StrCat("the body of ", exchange.content_length(),
                                            " bytes is over the limit of ", limits.max_bytes,
                                            " (--max-message-mib)")),
                      /*close=*/true);
  }
  const std::string& model = exchange.params.at("model");
  HttpInferCall call(&exchange, model, Version(exchange), arrival, *deadline, limits);
  admission.Admit(&call);
  const absl::Status status = call.Wait();
  if (!status.ok()) return ReplyError(exchange, status, /*close=*/!call.body_read());
  const HttpInferReply reply = EncodeHttpInfer(model, call.computed_by(), call.decoded());
  if (reply.binary.empty()) return exchange.Reply(200, kJson, reply.json);
  exchange.Reply(200, "application/octet-stream", reply.json, reply.binary,
                 {{"Inference-Header-Content-Length", std::to_string(reply.json.size())}});
}

}  // namespace

void ReplyError(HttpExchange& exchange, const absl::Status& status, bool close) {
  exchange.Reply(HttpStatus(status), kJson, ErrorJson(status.message()), {}, {}, close);
}

void AddOipRoutes(Admission* admission, HttpBodyLimits limits, HttpRouter* router) {
  router->Add("GET", "/v2/health/live",
              [](HttpExchange& exchange) { exchange.Reply(200, kJson, "{\"live\":true}"); });
  router->Add("GET", "/v2/health/ready", [admission](HttpExchange& exchange) {
    // The protocol's "not ready" is a 400-range status.
    const bool ready = admission->accepting();
    exchange.Reply(ready ? 200 : 400, kJson, ready ? "{\"ready\":true}" : "{\"ready\":false}");
  });
  auto model_ready = [admission](HttpExchange& exchange) {
    absl::StatusOr<ModelRegistry::Found> model = FindModel(*admission, exchange);
    if (!model.ok()) return ReplyError(exchange, model.status());
    const bool ready = admission->accepting();
    exchange.Reply(ready ? 200 : 400, kJson, ready ? "{\"ready\":true}" : "{\"ready\":false}");
  };
  router->Add("GET", "/v2/models/{model}/ready", model_ready);
  router->Add("GET", "/v2/models/{model}/versions/{version}/ready", model_ready);
  router->Add("GET", "/v2", [](HttpExchange& exchange) {
    exchange.Reply(200, kJson,
                   absl::StrCat("{\"name\":\"attnserve\",\"version\":\"", ATTNSERVE_VERSION,
                                "\",\"extensions\":[\"parameters\",\"binary_tensor_data\"]}"));
  });
  auto metadata = [admission](HttpExchange& exchange) {
    absl::StatusOr<ModelRegistry::Found> model = FindModel(*admission, exchange);
    if (!model.ok()) return ReplyError(exchange, model.status());
    exchange.Reply(200, kJson, ModelMetadataJson(DescribeFound(admission->registry(), *model)));
  };
  router->Add("GET", "/v2/models/{model}", metadata);
  router->Add("GET", "/v2/models/{model}/versions/{version}", metadata);
  auto infer = [admission, limits](HttpExchange& exchange) { Infer(*admission, limits, exchange); };
  router->Add("POST", "/v2/models/{model}/infer", infer);
  router->Add("POST", "/v2/models/{model}/versions/{version}/infer", infer);
}

}  // namespace attnserve::server
