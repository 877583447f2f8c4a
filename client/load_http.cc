#include "client/load_http.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/wire.h"
#include "nlohmann/json.hpp"

namespace attnserve::client {
namespace {

// The float values of a wire tensor, in either encoding.
std::vector<float> FloatsOf(const v1::Tensor& tensor) {
  if (tensor.raw().empty()) return {tensor.values().begin(), tensor.values().end()};
  std::vector<float> values(tensor.raw().size() / sizeof(float));
  std::memcpy(values.data(), tensor.raw().data(), values.size() * sizeof(float));
  return values;
}

void AppendFloats(std::span<const float> values, std::string* json) {
  char text[32];
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) *json += ',';
    const auto result = std::to_chars(text, text + sizeof(text), values[i]);
    json->append(text, result.ptr);
  }
}

// Builds the inputs of one call: each a JSON header and, when binary, its bytes.
class RestInputs {
 public:
  explicit RestInputs(RestEncoding encoding) : encoding_(encoding) {}

  void AddFloats(const char* name, const std::vector<int64_t>& shape,
                 const std::vector<float>& values) {
    Begin(name, "FP32", shape);
    if (encoding_ == RestEncoding::kBinary) {
      EndBinary(values.data(), values.size() * sizeof(float));
      return;
    }
    json_ += ",\"data\":[";
    AppendFloats(values, &json_);
    json_ += "]}";
  }

  void AddInts(const char* name, const google::protobuf::RepeatedField<int32_t>& values) {
    Begin(name, "INT32", {static_cast<int64_t>(values.size())});
    if (encoding_ == RestEncoding::kBinary) {
      EndBinary(values.data(), values.size() * sizeof(int32_t));
      return;
    }
    absl::StrAppend(&json_, ",\"data\":[", absl::StrJoin(values, ","), "]}");
  }

  const std::string& json() const { return json_; }
  const std::string& binary() const { return binary_; }

 private:
  void Begin(const char* name, const char* datatype, const std::vector<int64_t>& shape) {
    if (!json_.empty()) json_ += ',';
    absl::StrAppend(&json_, "{\"name\":\"", name, "\",\"datatype\":\"", datatype, "\",\"shape\":[",
                    absl::StrJoin(shape, ","), "]");
  }
  void EndBinary(const void* data, size_t bytes) {
    absl::StrAppend(&json_, ",\"parameters\":{\"binary_data_size\":", bytes, "}}");
    binary_.append(static_cast<const char*>(data), bytes);
  }

  const RestEncoding encoding_;
  std::string json_, binary_;
};

std::vector<int64_t> ShapeOf(const v1::Tensor& tensor) {
  return {tensor.shape().begin(), tensor.shape().end()};
}

std::string ModelPath(const std::string& model, uint64_t version) {
  std::string path = absl::StrCat("/v2/models/", model);
  if (version != 0) absl::StrAppend(&path, "/versions/", version);
  return path;
}

std::string AuthorizationHeader(const std::string& token) {
  return token.empty() ? "" : absl::StrCat("Authorization: Bearer ", token, "\r\n");
}

}  // namespace

absl::StatusOr<RestCall> EncodeRestInfer(const v1::ForwardRequest& request,
                                         const std::string& model, RestEncoding encoding,
                                         const std::string& token) {
  const std::string& name = request.model().empty() ? model : request.model();
  if (name.empty()) return absl::InvalidArgumentError("a REST call names its model");
  RestInputs inputs(encoding);
  inputs.AddFloats("input", ShapeOf(request.input()), FloatsOf(request.input()));
  if (!request.lengths().empty()) inputs.AddInts("lengths", request.lengths());
  if (request.has_context()) {
    inputs.AddFloats("context", ShapeOf(request.context()), FloatsOf(request.context()));
    if (!request.context_lengths().empty()) {
      inputs.AddInts("context_lengths", request.context_lengths());
    }
  }
  RestCall call;
  call.path = ModelPath(name, request.version()) + "/infer";
  const bool binary = encoding == RestEncoding::kBinary;
  const std::string json = absl::StrCat(
      "{\"parameters\":{\"kind\":\"", KindFlagName(request.kind()),
      "\",\"return_attention\":", request.return_attention() ? "true" : "false",
      ",\"binary_data_output\":", binary ? "true" : "false", "},\"inputs\":[", inputs.json(), "]}");
  call.headers = absl::StrCat("Content-Type: application/json\r\n", AuthorizationHeader(token));
  if (binary) {
    absl::StrAppend(&call.headers, "Inference-Header-Content-Length: ", json.size(), "\r\n");
  }
  call.body = json + inputs.binary();
  return call;
}

absl::StatusOr<v1::ModelInfo> FindModelOverRest(const HttpUrl& url, const std::string& token,
                                                const std::string& name, uint64_t version,
                                                absl::Duration timeout) {
  HttpConnection connection(url);
  const std::string headers = AuthorizationHeader(token);
  std::string wanted = name;
  if (wanted.empty()) {
    // The only model served: the repository index lists every model the server knows, with
    // its state.
    absl::StatusOr<HttpResponse> index =
        connection.Exchange("POST", "/v2/repository/index", headers, "{}", timeout);
    if (!index.ok()) return index.status();
    if (absl::Status s = StatusOfHttp(*index); !s.ok()) return s;
    const nlohmann::json models = nlohmann::json::parse(index->body, nullptr, false);
    std::vector<std::string> names;
    for (const auto& model : models.is_array() ? models : nlohmann::json::array()) {
      const std::string model_name = model.value("name", "");
      if (model_name.empty() || model.value("state", "") != "READY") continue;
      if (std::find(names.begin(), names.end(), model_name) == names.end()) {
        names.push_back(model_name);
      }
    }
    if (names.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("name a model (--model): the server has several or none: ",
                       names.empty() ? "none" : absl::StrJoin(names, ", ")));
    }
    wanted = names[0];
  }
  absl::StatusOr<HttpResponse> metadata =
      connection.Exchange("GET", ModelPath(wanted, version), headers, "", timeout);
  if (!metadata.ok()) return metadata.status();
  if (absl::Status s = StatusOfHttp(*metadata); !s.ok()) return s;
  const nlohmann::json json = nlohmann::json::parse(metadata->body, nullptr, false);
  v1::ModelInfo model;
  model.set_name(wanted);
  if (!json.is_object() || !json.contains("inputs") || !json["inputs"].is_array()) {
    return absl::DataLossError(absl::StrCat("the metadata of ", wanted, " has no inputs"));
  }
  for (const auto& input : json["inputs"]) {
    const auto& shape = input.value("shape", nlohmann::json::array());
    if (!shape.is_array() || shape.empty() || !shape.back().is_number_integer()) continue;
    const int64_t width = shape.back().get<int64_t>();
    if (input.value("name", "") == "input") model.set_d_model(width);
    if (input.value("name", "") == "context") model.set_d_context(width);
  }
  if (model.d_model() <= 0) {
    return absl::DataLossError(absl::StrCat("the metadata of ", wanted, " gives no input width"));
  }
  return model;
}

HttpLoadSender::HttpLoadSender(HttpUrl url, std::string model, RestEncoding encoding,
                               std::string token, absl::Duration timeout, int connections)
    : url_(std::move(url)),
      model_(std::move(model)),
      encoding_(encoding),
      token_(std::move(token)),
      timeout_(timeout),
      check_connection_(url_) {
  for (int i = 0; i < connections; ++i) threads_.emplace_back([this] { Serve(); });
}

HttpLoadSender::~HttpLoadSender() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void HttpLoadSender::SendAsync(const WorkItem& item, std::function<void(absl::Status)> done) const {
  {
    std::lock_guard lock(mu_);
    queue_.emplace_back(&item, std::move(done));
  }
  changed_.notify_one();
}

absl::Status HttpLoadSender::Send(const WorkItem& item) const {
  std::lock_guard lock(check_mu_);
  return Exchange(check_connection_, item);
}

void HttpLoadSender::Serve() const {
  HttpConnection connection(url_);
  while (true) {
    std::pair<const WorkItem*, std::function<void(absl::Status)>> call;
    {
      std::unique_lock lock(mu_);
      changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every call handed in answered
      call = std::move(queue_.front());
      queue_.pop_front();
    }
    call.second(Exchange(connection, *call.first));
  }
}

absl::StatusOr<std::shared_ptr<const RestCall>> HttpLoadSender::Encoded(
    const WorkItem& item) const {
  std::lock_guard lock(encoded_mu_);
  auto it = encoded_.find(&item);
  if (it != encoded_.end()) return it->second;
  absl::StatusOr<RestCall> call = EncodeRestInfer(item.request, model_, encoding_, token_);
  if (!call.ok()) return call.status();
  auto shared = std::make_shared<const RestCall>(*std::move(call));
  encoded_.emplace(&item, shared);
  return shared;
}

absl::Status HttpLoadSender::Exchange(HttpConnection& connection, const WorkItem& item) const {
  absl::StatusOr<std::shared_ptr<const RestCall>> call = Encoded(item);
  if (!call.ok()) return call.status();
  absl::StatusOr<HttpResponse> response =
      connection.Exchange("POST", (*call)->path, (*call)->headers, (*call)->body, timeout_);
  if (!response.ok()) return response.status();
  return StatusOfHttp(*response);
}

}  // namespace attnserve::client
