#include "server/frontends/http/oip_routes.h"

#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/frontends/http/http_status.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/oip/inference_service.h"
#include "server/frontends/oip/sequence_step.h"
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

void Reply(HttpExchange& exchange, absl::string_view model, int64_t version,
           const DecodedHttpInfer& decoded) {
  const HttpInferReply reply = EncodeHttpInfer(model, version, decoded);
  if (reply.binary.empty()) return exchange.Reply(200, kJson, reply.json);
  exchange.Reply(200, "application/octet-stream", reply.json, reply.binary,
                 {{"Inference-Header-Content-Length", std::to_string(reply.json.size())}});
}

// A step of a sequence's session (sequence_step.h), run on the connection's thread until
// it is answered (by the compute thread, or here when it ran inline). Past the call's
// deadline, a step still waiting for its turn is taken back, and one that computed is answered
// DeadlineExceeded as well (as gRPC's deadline does), its message saying the sequence holds it.
absl::Status RunSequenceStep(Admission& admission, SequenceTable& sequences,
                             const HttpExchange& exchange, HttpInferCall& call) {
  const std::string& model = exchange.params.at("model");
  // Counted by what the server did, as over gRPC: a step that computed past its deadline is OK
  // here though its caller gets 504.
  auto answer = [&](const absl::Status& status) {
    admission.SessionMessageAnswered(model, status);
    call.Finish(status);
  };
  if (absl::Status decoded = call.DecodeBody(); !decoded.ok()) {
    answer(decoded);
    return call.Wait();
  }
  if (Clock::now() >= call.deadline()) {
    answer(absl::DeadlineExceededError("the deadline passed before the step began"));
    return call.Wait();
  }
  DecodedHttpInfer& decoded = call.decoded();
  SequenceRequest request;
  request.model = model;
  request.version = Version(exchange);
  request.params = *decoded.sequence;
  request.kind_given = decoded.kind_given;
  request.args = &decoded.args;
  request.reply_bytes = [&](const core::ForwardShapes& shapes) { return call.ReplyBytes(shapes); };
  request.prepare = [&](const core::ForwardShapes& shapes, int64_t version) {
    call.set_computed_by(version);
    return PrepareHttpOutputs(shapes, &decoded);
  };
  SequenceStep step(&admission, &sequences);
  step.Run(request, answer);
  return call.Wait(
      [&step] {
        step.Cancel(absl::DeadlineExceededError(
            "the deadline passed while the step waited for its turn: the sequence is unchanged"));
      },
      "the deadline passed while the step computed; the sequence holds it");
}

void Infer(Admission& admission, SequenceTable& sequences, const HttpBodyLimits& limits,
           HttpExchange& exchange) {
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
  // The body is read before admission (REST carries sequence parameters in it), unless the
  // server is shutting down, and parsed after admission's refusals unless it names a sequence.
  // A body that cannot be read is refused by admission too, so that every call is counted.
  absl::StatusOr<HttpInferBody> body =
      admission.accepting() ? ReadInferBody(exchange, limits) : ShuttingDown();
  const bool body_read = body.ok();
  const std::string& model = exchange.params.at("model");
  HttpInferCall call(model, Version(exchange), std::move(body), arrival, *deadline);
  if (call.IsSequenceStep()) {
    const absl::Status status = RunSequenceStep(admission, sequences, exchange, call);
    if (!status.ok()) return ReplyError(exchange, status);
    return Reply(exchange, model, call.computed_by(), call.decoded());
  }
  admission.Admit(&call);
  const absl::Status status = call.Wait();
  if (!status.ok()) return ReplyError(exchange, status, /*close=*/!body_read);
  Reply(exchange, model, call.computed_by(), call.decoded());
}

}  // namespace

void ReplyError(HttpExchange& exchange, const absl::Status& status, bool close) {
  exchange.Reply(HttpStatus(status), kJson, ErrorJson(status.message()), {}, {}, close);
}

void AddOipRoutes(Admission* admission, SequenceTable* sequences, HttpBodyLimits limits,
                  HttpRouter* router) {
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
  auto infer = [admission, sequences, limits](HttpExchange& exchange) {
    Infer(*admission, *sequences, limits, exchange);
  };
  router->Add("POST", "/v2/models/{model}/infer", infer);
  router->Add("POST", "/v2/models/{model}/versions/{version}/infer", infer);
}

}  // namespace attnserve::server
