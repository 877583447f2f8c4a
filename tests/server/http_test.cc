// The Open Inference Protocol over HTTP/REST on a real server's REST port, over real sockets:
// every endpoint; JSON (nested and flat) and binary requests of every datatype the gRPC form
// takes answer the same bits as ModelInfer on the same server; every error status; TLS, mTLS
// and tokens; drain; and a malformed-HTTP suite (bad request lines, huge headers, chunked bodies
// with wrong sizes, bodies shorter or longer than Content-Length, invalid UTF-8, NaN, deep
// nesting, slow and idle clients), after which the server still serves.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "server/frontends/http/http_infer_call.h"
#include "server/frontends/http/http_router.h"
#include "server/frontends/http/http_server.h"
#include "server/frontends/http/http_status.h"
#include "server/frontends/oip/inference_service.h"
#include "server/serving/too_large.h"
#include "tests/common/all_near.h"
#include "tests/common/certificates.h"
#include "tests/server/http_client.h"
#include "tests/server/scrape.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using Json = nlohmann::json;

#if defined(__clang__) && __clang_major__ < 15
using Half = __fp16;
#else
using Half = _Float16;
#endif

constexpr int kWidth = 256;  // the demo layer's d_model

ServerOptions DemoOptions() {
  ServerOptions options;
  ModelConfig demo;
  demo.name = "demo";
  options.models = {demo};
  options.http_listen = "127.0.0.1:0";
  options.http_max_connections = 64;
  return options;
}

// `count` smooth values, different for each `seed`.
std::vector<float> Wave(size_t count, int seed = 0) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = 0.5f * std::sin(0.37f * i + seed) + 0.01f * seed;
  return values;
}

// `values` as a JSON array nested to `shape` (flat when `shape` is empty).
Json Nested(const std::vector<float>& values, const std::vector<int64_t>& shape) {
  if (shape.size() <= 1) return Json(values);
  const int64_t inner = values.size() / shape[0];
  Json array = Json::array();
  const std::vector<int64_t> rest(shape.begin() + 1, shape.end());
  for (int64_t i = 0; i < shape[0]; ++i) {
    array.push_back(Nested({values.begin() + i * inner, values.begin() + (i + 1) * inner}, rest));
  }
  return array;
}

std::string Bytes(const void* data, size_t size) {
  return std::string(static_cast<const char*>(data), size);
}

std::string HalfBytes(const std::vector<float>& values, bool bf16) {
  std::vector<uint16_t> halves(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(values[i]);
    halves[i] = bf16 ? static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)
                     : std::bit_cast<uint16_t>(static_cast<Half>(values[i]));
  }
  return Bytes(halves.data(), halves.size() * 2);
}

// One tensor of a test call, with the datatype and bytes it travels as.
struct Tensor {
  std::string name, datatype;
  std::vector<int64_t> shape;
  std::vector<float> floats;  // FP32, FP16, BF16 (rounded on the wire)
  std::vector<int32_t> ints;  // INT32
  std::string raw() const {
    if (datatype == "INT32") return Bytes(ints.data(), ints.size() * 4);
    if (datatype == "FP32") return Bytes(floats.data(), floats.size() * 4);
    return HalfBytes(floats, datatype == "BF16");
  }
};

// A call: tensors, kind, outputs asked for.
struct Call {
  std::vector<Tensor> tensors;
  std::string kind = "bidirectional";
  bool return_attention = false;
};

ModelInferRequest ToGrpc(const Call& call) {
  ModelInferRequest request;
  request.set_model_name("demo");
  (*request.mutable_parameters())["kind"].set_string_param(call.kind);
  (*request.mutable_parameters())["return_attention"].set_bool_param(call.return_attention);
  for (const Tensor& t : call.tensors) {
    auto* input = request.add_inputs();
    input->set_name(t.name);
    input->set_datatype(t.datatype);
    input->mutable_shape()->Assign(t.shape.begin(), t.shape.end());
    request.add_raw_input_contents(t.raw());
  }
  return request;
}

// How the REST form of a call carries its tensors.
enum class Form { kNested, kFlat, kBinary };

// The body and headers of `call` in `form` (half types always binary); outputs binary too when
// `binary_output`.
std::pair<std::string, std::vector<std::string>> ToRest(const Call& call, Form form,
                                                        bool binary_output = false) {
  Json request = {{"id", "rest-call"},
                  {"parameters",
                   {{"kind", call.kind},
                    {"return_attention", call.return_attention},
                    {"binary_data_output", binary_output}}}};
  std::string binary;
  for (const Tensor& t : call.tensors) {
    Json input = {{"name", t.name}, {"datatype", t.datatype}, {"shape", t.shape}};
    if (form == Form::kBinary || (t.datatype != "FP32" && t.datatype != "INT32")) {
      const std::string raw = t.raw();
      input["parameters"] = {{"binary_data_size", raw.size()}};
      binary += raw;
    } else if (t.datatype == "INT32") {
      input["data"] = t.ints;
    } else {
      input["data"] = Nested(t.floats, form == Form::kNested ? t.shape : std::vector<int64_t>{});
    }
    request["inputs"].push_back(input);
  }
  const std::string json = request.dump();
  std::vector<std::string> headers = {"Content-Type: application/json"};
  if (binary.empty()) return {json, headers};
  headers.push_back(absl::StrCat("Inference-Header-Content-Length: ", json.size()));
  return {json + binary, headers};
}

using Outputs = std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>;

// The numbers of the JSON array that starts at `text[at]`, read as float by from_chars (exactly
// rounded, so the bits compare).
std::vector<float> FloatsAt(const std::string& text, size_t at) {
  std::vector<float> values;
  size_t i = at + 1;
  while (i < text.size() && text[i] != ']') {
    float value = 0;
    const auto [end, error] = std::from_chars(text.data() + i, text.data() + text.size(), value);
    EXPECT_EQ(error, std::errc());
    values.push_back(value);
    i = end - text.data();
    if (text[i] == ',') ++i;
  }
  return values;
}

// The outputs of a REST reply, JSON or binary.
Outputs RestOutputs(const HttpReply& reply) {
  Outputs outputs;
  const auto header = reply.headers.find("inference-header-content-length");
  const size_t json_length =
      header == reply.headers.end() ? reply.body.size() : std::stoul(header->second);
  const std::string json_text = reply.body.substr(0, json_length);
  const Json json = Json::parse(json_text);
  size_t offset = json_length;
  size_t search = 0;
  for (const Json& output : json["outputs"]) {
    auto& [shape, values] = outputs[output["name"]];
    shape = output["shape"].get<std::vector<int64_t>>();
    if (output.contains("parameters") && output["parameters"].contains("binary_data_size")) {
      const size_t size = output["parameters"]["binary_data_size"];
      values.resize(size / 4);
      std::memcpy(values.data(), reply.body.data() + offset, size);
      offset += size;
    } else {
      search = json_text.find("\"data\":[", search) + 7;
      values = FloatsAt(json_text, search);
    }
  }
  return outputs;
}

// Empty when the two have the same outputs, shapes and bits.
std::string SameBits(const Outputs& rest, const Outputs& grpc) {
  if (rest.size() != grpc.size()) return "different outputs";
  for (const auto& [name, want] : grpc) {
    const auto it = rest.find(name);
    if (it == rest.end()) return name + " missing";
    if (it->second.first != want.first) return name + ": shapes differ";
    if (it->second.second.size() != want.second.size()) return name + ": sizes differ";
    for (size_t i = 0; i < want.second.size(); ++i) {
      if (std::bit_cast<uint32_t>(it->second.second[i]) !=
          std::bit_cast<uint32_t>(want.second[i])) {
        return absl::StrCat(name, ": element ", i, " is ", it->second.second[i], ", ModelInfer ",
                            want.second[i]);
      }
    }
  }
  return "";
}

class HttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = StartServer(DemoOptions()).release(); }
  static void TearDownTestSuite() { delete server_; }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(server_->http_port(), 0);
  }

  static std::string Url(const std::string& path) {
    return absl::StrCat("http://127.0.0.1:", server_->http_port(), path);
  }

  Outputs GrpcOutputs(const Call& call) {
    auto stub = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
    grpc::ClientContext context;
    ModelInferResponse response;
    const grpc::Status status = stub->ModelInfer(&context, ToGrpc(call), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    Outputs outputs;
    for (int i = 0; i < response.outputs_size(); ++i) {
      const auto& tensor = response.outputs(i);
      auto& [shape, values] = outputs[tensor.name()];
      shape.assign(tensor.shape().begin(), tensor.shape().end());
      const std::string& bytes = response.raw_output_contents(i);
      values.resize(bytes.size() / 4);
      std::memcpy(values.data(), bytes.data(), bytes.size());
    }
    return outputs;
  }

  HttpReply Infer(const std::string& body, const std::vector<std::string>& headers,
                  const std::string& model = "demo") {
    return HttpCall("POST", Url("/v2/models/" + model + "/infer"), body, headers);
  }

  static Server* server_;
};

Server* HttpTest::server_ = nullptr;

TEST_F(HttpTest, HealthEndpoints) {
  EXPECT_EQ(HttpCall("GET", Url("/v2/health/live")).status, 200);
  EXPECT_EQ(HttpCall("GET", Url("/v2/health/ready")).status, 200);
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo/ready")).status, 200);
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo/versions/1/ready")).status, 200);
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo/versions/2/ready")).status, 404);
  const HttpReply unknown = HttpCall("GET", Url("/v2/models/nope/ready"));
  EXPECT_EQ(unknown.status, 404);
  EXPECT_TRUE(Json::parse(unknown.body).contains("error")) << unknown.body;
}

TEST_F(HttpTest, ServerMetadataListsTheExtensions) {
  const HttpReply reply = HttpCall("GET", Url("/v2"));
  ASSERT_EQ(reply.status, 200);
  EXPECT_EQ(reply.headers.at("content-type"), "application/json");
  const Json json = Json::parse(reply.body);
  EXPECT_EQ(json["name"], "attnserve");
  EXPECT_EQ(json["version"], ATTNSERVE_PROJECT_VERSION);
  EXPECT_EQ(json["extensions"], Json({"parameters", "binary_tensor_data"}));
}

TEST_F(HttpTest, ModelMetadataIsModelMetadatasContract) {
  auto stub = inference::GRPCInferenceService::NewStub(Connect(server_->port()));
  grpc::ClientContext context;
  inference::ModelMetadataRequest asked;
  asked.set_name("demo");
  inference::ModelMetadataResponse want;
  ASSERT_TRUE(stub->ModelMetadata(&context, asked, &want).ok());
  for (const std::string path : {"/v2/models/demo", "/v2/models/demo/versions/1"}) {
    const HttpReply reply = HttpCall("GET", Url(path));
    ASSERT_EQ(reply.status, 200) << path;
    const Json json = Json::parse(reply.body);
    EXPECT_EQ(json["name"], want.name());
    EXPECT_EQ(json["platform"], want.platform());
    EXPECT_EQ(json["versions"], Json({"1"}));
    for (const auto& [key, tensors] :
         {std::pair{"inputs", &want.inputs()}, std::pair{"outputs", &want.outputs()}}) {
      ASSERT_EQ(json[key].size(), static_cast<size_t>(tensors->size()));
      for (int i = 0; i < tensors->size(); ++i) {
        EXPECT_EQ(json[key][i]["name"], tensors->Get(i).name());
        EXPECT_EQ(json[key][i]["datatype"], tensors->Get(i).datatype());
        EXPECT_EQ(
            json[key][i]["shape"].get<std::vector<int64_t>>(),
            std::vector<int64_t>(tensors->Get(i).shape().begin(), tensors->Get(i).shape().end()));
      }
    }
  }
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo/versions/7")).status, 404);
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/nope")).status, 404);
}

TEST_F(HttpTest, UnknownPathsAndMethods) {
  EXPECT_EQ(HttpCall("GET", Url("/v3")).status, 404);
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo/infer")).status, 405);
  EXPECT_EQ(HttpCall("DELETE", Url("/v2/health/live")).status, 405);
}

// Paths are %-decoded, but a %00 (which a C string would end the path at: demo%00x/ready read as
// demo's metadata) or a malformed escape is refused, not routed.
TEST_F(HttpTest, EscapesInPathsAreDecodedAndANulByteIsRefused) {
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/de%6Do/ready")).status, 200);
  const HttpReply nul = HttpCall("GET", Url("/v2/models/demo%00x/ready"));
  EXPECT_EQ(nul.status, 400) << nul.body;
  EXPECT_NE(nul.body.find("%00"), std::string::npos) << nul.body;
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo%00x")).status, 400);
  EXPECT_EQ(HttpCall("GET", Url("/v2/models/demo%2")).status, 400);
  EXPECT_EQ(HttpCall("GET", Url("/v2/health/ready")).status, 200);
}

// The calls every encoding is checked on: padded with lengths, packed, cross with context
// lengths, causal with attention.
std::vector<Call> Calls(const std::string& float_type, const std::string& length_type = "INT32") {
  const int b = 2, s = 16;
  Tensor input{"input", float_type, {b, s, kWidth}, Wave(b * s * kWidth, 1), {}};
  Tensor lengths{"lengths", length_type, {b}, {}, {16, 9}};
  Tensor packed{"input", float_type, {25, kWidth}, Wave(25 * kWidth, 2), {}};
  Tensor context{"context", float_type, {b, 8, kWidth}, Wave(b * 8 * kWidth, 3), {}};
  Tensor context_lengths{"context_lengths", length_type, {b}, {}, {8, 3}};
  Call padded{{input, lengths}};
  Call packed_call{{packed, lengths}, "causal"};
  Call cross{{input, lengths, context, context_lengths}, "cross"};
  Call attention{{input}, "causal", /*return_attention=*/true};
  return {padded, packed_call, cross, attention};
}

TEST_F(HttpTest, JsonNestedFlatAndBinaryGiveModelInfersBits) {
  for (const Call& call : Calls("FP32")) {
    const Outputs want = GrpcOutputs(call);
    for (Form form : {Form::kNested, Form::kFlat, Form::kBinary}) {
      for (bool binary_output : {false, true}) {
        const auto [body, headers] = ToRest(call, form, binary_output);
        const HttpReply reply = Infer(body, headers);
        ASSERT_EQ(reply.status, 200) << reply.body.substr(0, 300);
        EXPECT_EQ(SameBits(RestOutputs(reply), want), "")
            << call.kind << " form " << static_cast<int>(form) << " binary " << binary_output;
      }
    }
  }
}

TEST_F(HttpTest, HalfTypesAndBinaryLengthsGiveModelInfersBits) {
  for (const std::string type : {"FP16", "BF16"}) {
    for (const Call& call : Calls(type)) {
      const auto [body, headers] = ToRest(call, Form::kFlat);
      const HttpReply reply = Infer(body, headers);
      ASSERT_EQ(reply.status, 200) << reply.body.substr(0, 300);
      EXPECT_EQ(SameBits(RestOutputs(reply), GrpcOutputs(call)), "") << type << " " << call.kind;
    }
  }
  const Call call = Calls("FP32")[0];
  const auto [body, headers] = ToRest(call, Form::kBinary);  // INT32 lengths as bytes too
  EXPECT_EQ(SameBits(RestOutputs(Infer(body, headers)), GrpcOutputs(call)), "");
}

TEST_F(HttpTest, OnlyTheRequestedOutputsAndTheIdComeBack) {
  const Call call = Calls("FP32")[3];
  auto [body, headers] = ToRest(call, Form::kFlat);
  Json request = Json::parse(body);
  request["outputs"] = {{{"name", "attention"}, {"parameters", {{"binary_data", true}}}}};
  const HttpReply reply = Infer(request.dump(), headers);
  ASSERT_EQ(reply.status, 200) << reply.body;
  const Outputs outputs = RestOutputs(reply);
  ASSERT_EQ(outputs.size(), 1u);
  EXPECT_EQ(outputs.begin()->first, "attention");
  EXPECT_EQ(outputs.begin()->second.second, GrpcOutputs(call).at("attention").second);
  const Json json = Json::parse(
      reply.body.substr(0, std::stoul(reply.headers.at("inference-header-content-length"))));
  EXPECT_EQ(json["id"], "rest-call");
  EXPECT_EQ(json["model_name"], "demo");
  EXPECT_EQ(json["model_version"], "1");
}

// The repository extension over REST answers as the gRPC one: the index for anyone, load and
// unload refused in control mode none (FAILED_PRECONDITION: 400) after the loopback rule let
// the caller through.
TEST_F(HttpTest, RepositoryEndpointsAnswerAsTheGrpcApi) {
  const HttpReply index = HttpCall("POST", Url("/v2/repository/index"), "{}", {});
  EXPECT_EQ(index.status, 200) << index.body;
  EXPECT_NE(index.body.find("\"name\":\"demo\""), std::string::npos) << index.body;
  EXPECT_NE(index.body.find("\"state\":\"READY\""), std::string::npos) << index.body;
  const HttpReply load = HttpCall("POST", Url("/v2/repository/models/demo/load"), "", {});
  EXPECT_EQ(load.status, 400) << load.body;
  EXPECT_NE(load.body.find("explicit"), std::string::npos) << load.body;
  const HttpReply unload = HttpCall("POST", Url("/v2/repository/models/demo/unload"), "", {});
  EXPECT_EQ(unload.status, 400) << unload.body;
  EXPECT_EQ(HttpCall("GET", Url("/v2/repository/index")).status, 405);
}

// A load or unload without the admin token is answered 403 before its body is read: a caller who
// may not load cannot hold a connection's thread, nor the body's memory, for the body's time.
TEST(HttpRepositoryTest, ALoadWithoutTheAdminTokenIsRefusedBeforeItsBodyIsRead) {
  ServerOptions options = DemoOptions();
  options.admin_token_file = TempPath("http-admin-tokens");
  std::ofstream(options.admin_token_file) << "admin-secret\n";
  options.http_body_timeout_ms = 30000;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  for (const char* action : {"load", "unload"}) {
    // Headers and the body's first byte; the other 4095 never come.
    const std::string answer =
        RawExchange(server->http_port(),
                    absl::StrCat("POST /v2/repository/models/demo/", action,
                                 " HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n{"),
                    std::chrono::seconds(5));
    EXPECT_EQ(RawStatus(answer), 403) << action << ": " << answer;
    EXPECT_NE(answer.find("admin token"), std::string::npos) << answer;
  }
}

TEST(HttpStatusTest, EveryCodeHasItsStatus) {
  EXPECT_EQ(HttpStatus(absl::OkStatus()), 200);
  EXPECT_EQ(HttpStatus(absl::InvalidArgumentError("")), 400);
  EXPECT_EQ(HttpStatus(absl::UnauthenticatedError("")), 401);
  EXPECT_EQ(HttpStatus(absl::PermissionDeniedError("")), 403);
  EXPECT_EQ(HttpStatus(absl::NotFoundError("")), 404);
  EXPECT_EQ(HttpStatus(TooLarge("")), 413);
  EXPECT_EQ(HttpStatus(MessageTooLarge("the reply would take")), 413);
  EXPECT_EQ(HttpStatus(absl::ResourceExhaustedError("queue full")), 429);
  EXPECT_EQ(HttpStatus(absl::UnavailableError("")), 503);
  EXPECT_EQ(HttpStatus(absl::DeadlineExceededError("")), 504);
  EXPECT_EQ(HttpStatus(absl::InternalError("")), 500);
  EXPECT_EQ(ErrorJson("bad \"x\" \xff\n"), "{\"error\":\"bad \\\"x\\\" \\ufffd\\u000a\"}");
}

// A valid flat JSON call of `rows` tokens.
std::string SmallCall(int rows = 4) {
  return ToRest({{Tensor{"input", "FP32", {1, rows, kWidth}, Wave(rows * kWidth), {}}}},
                Form::kFlat)
      .first;
}

// The body of a sequence step over REST: `tokens` rows of `values` (from `row`), flat JSON, or
// binary FP32 when `binary` (and binary outputs asked for when `binary_output`); the sequence
// parameters as Triton's HTTP client sends them.
std::pair<std::string, std::vector<std::string>> SequenceStepBody(const std::vector<float>& values,
                                                                  int row, int tokens,
                                                                  const Json& id, bool start,
                                                                  bool end, bool binary = false,
                                                                  bool binary_output = false) {
  const std::vector<float> rows(values.begin() + row * kWidth,
                                values.begin() + (row + tokens) * kWidth);
  Tensor input{"input", "FP32", {1, tokens, kWidth}, rows, {}};
  Call call{{input}, "causal"};
  auto [body, headers] = ToRest(call, binary ? Form::kBinary : Form::kFlat);
  const size_t json_length =
      binary ? std::stoul(headers.back().substr(headers.back().find(':') + 1)) : body.size();
  Json request = Json::parse(body.substr(0, json_length));
  request["parameters"].erase("kind");  // Triton's clients send none: a sequence is causal
  request["parameters"]["sequence_id"] = id;
  request["parameters"]["sequence_start"] = start;
  request["parameters"]["sequence_end"] = end;
  if (binary_output) request["parameters"]["binary_data_output"] = true;
  std::string json = request.dump();
  if (binary) headers.back() = absl::StrCat("Inference-Header-Content-Length: ", json.size());
  return {json + body.substr(json_length), headers};
}

// A sequence over REST is a decode session, as through ModelInfer: a 16-token prompt, single
// tokens, three at once (one of them binary), each step's outputs equal to the same rows of one
// causal Forward over the whole sequence; then the ended id, an unknown id and a bad id answer
// with their statuses, and the server serves on.
TEST_F(HttpTest, SequenceStepsAreASessionsSteps) {
  constexpr int kTokens = 23;
  const std::vector<float> values = Wave(kTokens * kWidth, 5);
  const Call whole{{Tensor{"input", "FP32", {1, kTokens, kWidth}, values, {}}}, "causal"};
  const std::vector<float> want = GrpcOutputs(whole).at("output").second;
  ASSERT_EQ(want.size(), static_cast<size_t>(kTokens * kWidth));
  const std::vector<int> steps = {16, 1, 1, 1, 1, 3};
  std::vector<float> got;
  int row = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto [body, headers] =
        SequenceStepBody(values, row, steps[i], "rest-sequence", i == 0, i + 1 == steps.size(),
                         /*binary=*/i == 3);
    const HttpReply reply = Infer(body, headers);
    ASSERT_EQ(reply.status, 200) << "step " << i << ": " << reply.body.substr(0, 300);
    const Outputs outputs = RestOutputs(reply);
    const auto& [shape, output] = outputs.at("output");
    EXPECT_EQ(shape, (std::vector<int64_t>{1, steps[i], kWidth}));
    got.insert(got.end(), output.begin(), output.end());
    row += steps[i];
  }
  ASSERT_TRUE(test::AllNear(got, want, 1e-5f));

  const auto [ended, headers] = SequenceStepBody(values, 0, 1, "rest-sequence", false, false);
  const HttpReply gone = Infer(ended, headers);
  EXPECT_EQ(gone.status, 404) << gone.body;
  EXPECT_NE(gone.body.find("rest-sequence"), std::string::npos) << gone.body;
  const auto [unknown, _] = SequenceStepBody(values, 0, 1, 424242, false, false);
  const HttpReply missing = Infer(unknown, headers);
  EXPECT_EQ(missing.status, 404) << missing.body;
  EXPECT_NE(missing.body.find("424242"), std::string::npos) << missing.body;
  const auto [bad, __] = SequenceStepBody(values, 0, 1, 1.5, true, false);
  const HttpReply refused = Infer(bad, headers);
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_NE(refused.body.find("sequence_id"), std::string::npos) << refused.body;
  // A name written with escapes is refused, not served as a one-shot call.
  std::string escaped = SequenceStepBody(values, 0, 1, 7, true, false).first;
  escaped.replace(escaped.find("sequence_id"), 11, "sequence\\u005fid");
  EXPECT_EQ(Infer(escaped, headers).status, 400) << escaped.substr(0, 120);
  // A refused first step starts nothing: the id stays unknown.
  Json narrow = Json::parse(SequenceStepBody(values, 0, 1, 8, true, false).first);
  narrow["inputs"][0]["shape"] = {1, 1, 8};
  narrow["inputs"][0]["data"] = std::vector<float>(8, 0.5f);
  EXPECT_EQ(Infer(narrow.dump(), headers).status, 400);
  EXPECT_EQ(Infer(SequenceStepBody(values, 0, 1, 8, false, false).first, headers).status, 404);
  EXPECT_EQ(Infer(SmallCall(), headers).status, 200);
}

TEST_F(HttpTest, RefusalsHaveTheirStatusAndAnErrorMessage) {
  const std::vector<std::string> json = {"Content-Type: application/json"};
  const std::vector<std::pair<std::string, int>> cases = {
      {"{", 400},
      {"", 400},
      {"[1,2]", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,256],"data":[NaN]}]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,2],"data":[1e999,1]}]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,256],"data":[3.5e38]}]})", 400},
      {R"({"inputs":[{"name":"bogus","datatype":"FP32","shape":[1],"data":[1]}]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP64","shape":[1,1,256],"data":[1]}]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP16","shape":[1,1,256],"data":[1]}]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,256],"data":[1,2]}]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,3],"data":[[[1,2,3]]],)"
       R"("x":"\xff"}]})",
       400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,256],"data":["1"]}]})", 400},
      {R"({"inputs":[]} {"trailing":1})", 400},
      {R"({"unknown":[1,,2],"inputs":[]})", 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shap2":,"shape":[1,1,2],"data":[1,2]}]})",
       400},
      {R"({"inputs":[],"inputs":[]})", 400},
      {R"({"parameters":{"kind":"sideways"},"inputs":[]})", 400},
      {std::string(100000, '[') + std::string(100000, ']'), 400},
      {R"({"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,2],"data":)" +
           std::string(5000, '[') + "1" + std::string(5000, ']') + "}]}",
       400},
  };
  for (const auto& [body, status] : cases) {
    const HttpReply reply = Infer(body, json);
    EXPECT_EQ(reply.status, status) << body.substr(0, 120);
    ASSERT_FALSE(reply.body.empty()) << body.substr(0, 120);
    EXPECT_TRUE(Json::parse(reply.body).contains("error")) << reply.body;
  }
  EXPECT_EQ(Infer(SmallCall(), json, "nope").status, 404);
  EXPECT_EQ(HttpCall("POST", Url("/v2/models/demo/versions/2/infer"), SmallCall(), json).status,
            404);
  EXPECT_EQ(Infer(SmallCall(), {"Request-Timeout-Ms: soon"}).status, 400);
  EXPECT_EQ(Infer(SmallCall(), {"Inference-Header-Content-Length: 99999"}).status, 400);
  EXPECT_EQ(Infer(SmallCall() + "xx",
                  {"Inference-Header-Content-Length: " + std::to_string(SmallCall().size())})
                .status,
            400);  // binary bytes no input claims
  // Binary lengths whose shape's bytes overflow (2^62 INT32 elements, none sent): 400, as a
  // one-shot call and as a sequence step.
  std::string zeros = "0";
  for (int i = 1; i < 256; ++i) zeros += ",0";
  for (const char* parameters : {"{}", R"({"sequence_id":1,"sequence_start":true})"}) {
    const std::string huge = absl::StrCat(
        R"({"parameters":)", parameters,
        R"(,"inputs":[{"name":"input","datatype":"FP32","shape":[1,1,256],"data":[)", zeros,
        R"(]},{"name":"lengths","datatype":"INT32","shape":[4611686018427387904],)",
        R"("parameters":{"binary_data_size":0}}]})");
    const HttpReply reply =
        Infer(huge, {"Inference-Header-Content-Length: " + std::to_string(huge.size())});
    EXPECT_EQ(reply.status, 400) << parameters << ": " << reply.body;
  }
  EXPECT_EQ(Infer(SmallCall(), json).status, 200);
}

TEST_F(HttpTest, APassedDeadlineIs504) {
  // A call far larger than one millisecond of compute.
  const Call big{{Tensor{"input", "FP32", {4, 512, kWidth}, Wave(4 * 512 * kWidth), {}}}, "causal"};
  const auto [body, headers] = ToRest(big, Form::kBinary);
  std::vector<std::string> with_timeout = headers;
  with_timeout.push_back("Request-Timeout-Ms: 1");
  EXPECT_EQ(Infer(body, with_timeout).status, 504);
  with_timeout.back() = "Request-Timeout-Ms: 60000";
  EXPECT_EQ(Infer(body, with_timeout).status, 200);
}

// A call that computes past its deadline is 504 too, not a late 200: the caller said it would
// not wait that long (gRPC's deadline ends such a call the same way).
TEST(HttpInferCallTest, ACallThatFinishesAfterItsDeadlineIs504) {
  const Clock::time_point now = Clock::now();
  HttpInferCall in_time("demo", "", HttpInferBody{}, now, now + std::chrono::seconds(30));
  in_time.Finish(absl::OkStatus());
  EXPECT_TRUE(in_time.Wait().ok());
  // Finished while its connection's thread waits, or before that thread came to wait.
  HttpInferCall late("demo", "", HttpInferBody{}, now, now + std::chrono::milliseconds(20));
  std::thread computing([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    late.Finish(absl::OkStatus());
  });
  const absl::Status status = late.Wait();
  computing.join();
  EXPECT_EQ(HttpStatus(status), 504) << status;
  HttpInferCall finished_late("demo", "", HttpInferBody{}, now,
                              now + std::chrono::milliseconds(20));
  std::this_thread::sleep_until(now + std::chrono::milliseconds(40));
  finished_late.Finish(absl::OkStatus());
  const absl::Status waited_after = finished_late.Wait();
  EXPECT_EQ(HttpStatus(waited_after), 504) << waited_after;
  // A failure is answered as what it is, late or not.
  HttpInferCall failed("demo", "", HttpInferBody{}, now, now + std::chrono::milliseconds(20));
  failed.Finish(absl::InternalError("the run failed"));
  EXPECT_EQ(failed.Wait().code(), absl::StatusCode::kInternal);
}

// Past Request-Timeout-Ms a sequence step is 504, as a call is: a step that waited for its turn
// behind another step of its sequence is taken back (the sequence does not hold it), and one
// that computed is answered 504 saying that the sequence holds it.
TEST(HttpSequenceDeadlineTest, StepsPastTheirDeadlineAre504AndAWaitingOneIsTakenBack) {
  ServerOptions options = DemoOptions();
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string url =
      absl::StrCat("http://127.0.0.1:", server->http_port(), "/v2/models/demo/infer");
  constexpr int kLong = 10000;  // far longer to compute than the deadlines below
  const std::vector<float> values = Wave((kLong + 6) * kWidth, 6);
  auto step = [&](int row, int tokens, const std::string& id, bool start, bool end,
                  int timeout_ms = 0) {
    auto [body, headers] = SequenceStepBody(values, row, tokens, id, start, end, true, true);
    if (timeout_ms > 0) headers.push_back(absl::StrCat("Request-Timeout-Ms: ", timeout_ms));
    return HttpCall("POST", url, body, headers);
  };
  auto decoded_tokens = [&] {
    absl::StatusOr<std::map<std::string, double>> series = Scrape(server->metrics_port());
    return series.ok() ? (*series)[SeriesKey("attnserve_decode_tokens_total", {{"model", "demo"}})]
                       : -1;
  };
  // What the sequence gives without the step taken back.
  ASSERT_EQ(step(0, 4, "whole", true, false).status, 200);
  ASSERT_EQ(step(4, kLong, "whole", false, false).status, 200);
  const HttpReply want = step(kLong + 5, 1, "whole", false, true);
  ASSERT_EQ(want.status, 200) << want.body.substr(0, 300);

  ASSERT_EQ(step(0, 4, "late", true, false).status, 200);
  const double before = decoded_tokens();
  HttpReply long_reply;
  std::atomic<bool> long_answered{false};
  std::thread long_step([&] {
    // 300 ms: time to read and check the 10 MB body before it (slow with sanitizers), and
    // well short of computing 10,000 tokens (most of a second on a fast machine).
    long_reply = step(4, kLong, "late", false, false, 300);
    long_answered = true;
  });
  for (int i = 0; i < 5000 && decoded_tokens() == before; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // While the long step computes, a step of the same sequence waits past its deadline.
  const HttpReply waited = step(kLong + 4, 1, "late", false, false, 20);
  const bool long_still_computing = !long_answered.load();
  long_step.join();
  ASSERT_TRUE(long_still_computing) << "the long step ended first: nothing waited";
  EXPECT_EQ(waited.status, 504) << waited.body;
  EXPECT_NE(waited.body.find("unchanged"), std::string::npos) << waited.body;
  EXPECT_EQ(long_reply.status, 504) << long_reply.body.substr(0, 300);
  EXPECT_NE(long_reply.body.find("holds it"), std::string::npos) << long_reply.body;
  // The sequence holds the prompt and the long step, not the step taken back.
  const HttpReply got = step(kLong + 5, 1, "late", false, true);
  ASSERT_EQ(got.status, 200) << got.body.substr(0, 300);
  // Messages are counted by what the server did, as over gRPC: the long step computed (OK,
  // beside the five other steps), the one taken back did not.
  absl::StatusOr<std::map<std::string, double>> series = Scrape(server->metrics_port());
  ASSERT_TRUE(series.ok()) << series.status();
  auto messages = [&](const std::string& code) {
    return (*series)[SeriesKey("attnserve_session_messages_total",
                               {{"model", "demo"}, {"code", code}})];
  };
  EXPECT_EQ(messages("OK"), 6);
  EXPECT_EQ(messages("DEADLINE_EXCEEDED"), 1);
  const std::vector<float> got_row = RestOutputs(got).at("output").second;
  const std::vector<float> want_row = RestOutputs(want).at("output").second;
  ASSERT_EQ(want_row.size(), static_cast<size_t>(kWidth));
  // One more token among 10,000 moves this row by about 1e-5; f32 rounding, by 1e-8.
  ASSERT_TRUE(test::AllNear(got_row, want_row, 1e-6f));
}

// A server whose messages are limited to 1 MiB, and its infer URL.
class HttpLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options = DemoOptions();
    options.max_message_mib = 1;
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
    url_ = absl::StrCat("http://127.0.0.1:", server_->http_port(), "/v2/models/demo/infer");
  }

  std::unique_ptr<Server> server_;
  std::string url_;
};

TEST_F(HttpLimitsTest, AReplyOverTheLimitIs413) {
  // A 1x2x256 call asking for its attention is small; 1x300 asks for 4x300x300 floats (1.4 MB).
  Call call{{Tensor{"input", "FP32", {1, 300, kWidth}, Wave(300 * kWidth), {}}}};
  call.return_attention = true;
  const auto [body, headers] = ToRest(call, Form::kBinary, /*binary_output=*/true);
  const HttpReply reply = HttpCall("POST", url_, body, headers);
  EXPECT_EQ(reply.status, 413) << reply.body;
}

// A sequence step whose reply would pass the limit is refused before it runs, as a call is:
// binary input in, JSON text out (16 bytes a float). The sequence is not started.
TEST_F(HttpLimitsTest, ASequenceStepWhoseReplyIsOverTheLimitIs413AndStartsNothing) {
  const std::string& url = url_;
  constexpr int kTokens = 700;  // 700 KB of binary input, 2.8 MB of JSON output
  const std::vector<float> values = Wave(kTokens * kWidth, 3);
  const auto [body, headers] = SequenceStepBody(values, 0, kTokens, "big", true, false, true);
  const HttpReply refused = HttpCall("POST", url, body, headers);
  EXPECT_EQ(refused.status, 413) << refused.body.substr(0, 300);
  EXPECT_NE(refused.body.find("--max-message-mib"), std::string::npos) << refused.body;
  const auto [next, next_headers] = SequenceStepBody(values, 0, 1, "big", false, false);
  EXPECT_EQ(HttpCall("POST", url, next, next_headers).status, 404)
      << "the refused sequence_start started the sequence";
  const auto [small, small_headers] = SequenceStepBody(values, 0, 4, "big", true, false);
  EXPECT_EQ(HttpCall("POST", url, small, small_headers).status, 200);
}

// A client that sends its whole body, too large, before it reads the answer gets the 413: the
// server reads what is left of the body for a moment before it closes (closed with unread bytes,
// the connection would be reset under the client's send).
TEST_F(HttpLimitsTest, AClientSendingATooLargeBodyWholeGetsIts413) {
  const std::string body(8 << 20, ' ');
  const std::string request = absl::StrCat(
      "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(), "\r\n\r\n",
      body);
  const int fd = ConnectLoopback(server_->http_port());
  ASSERT_GE(fd, 0);
  const timeval patience{10, 0};  // an answer that never comes fails the test, not hangs it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof(patience));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &patience, sizeof(patience));
  EXPECT_EQ(SendAll(fd, request), request.size())
      << "the connection was reset while the body was sent";
  std::string answer;
  char buffer[4096];
  for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) answer.append(buffer, n);
  close(fd);
  EXPECT_EQ(RawStatus(answer), 413) << answer;
}

TEST_F(HttpLimitsTest, ABodyOverTheLimitIs413BeforeItIsRead) {
  const std::string& url = url_;
  const HttpReply declared = HttpCall("POST", url, std::string(2 << 20, ' '), {});
  EXPECT_EQ(declared.status, 413);
  const std::string chunked_head =
      "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  std::string chunks;
  for (int i = 0; i < 20; ++i) chunks += "10000\r\n" + std::string(0x10000, ' ') + "\r\n";
  EXPECT_EQ(RawStatus(RawExchange(server_->http_port(), chunked_head + chunks + "0\r\n\r\n",
                                  std::chrono::seconds(1))),
            413);
}

// The bodies the REST port holds at once are bounded (--http-bodies-mib), counted as their bytes
// arrive: while a client holds most of that room with a body it stopped sending, another large
// body is refused 503 as it passes the room left, and a small call still goes through; the room
// comes back when the stalled request ends. Headers declaring a body that never comes hold none.
// attnserve_http_body_bytes shows what it holds, attnserve_http_body_limit_bytes the room.
TEST(HttpBodyBudgetTest, BodiesHeldAtOnceAreBoundedAndTheRoomComesBack) {
  ServerOptions options = DemoOptions();
  options.max_message_mib = 1;
  options.http_bodies_mib = 1;
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto gauge = [&](const std::string& name) {
    absl::StatusOr<std::map<std::string, double>> series = Scrape(server->metrics_port());
    return series.ok() && series->contains(name) ? (*series)[name] : -1.0;
  };
  const int64_t room = options.http_bodies_mib << 20;
  EXPECT_EQ(gauge("attnserve_http_body_limit_bytes"), static_cast<double>(room));
  EXPECT_EQ(gauge("attnserve_http_body_bytes"), 0);
  const int port = server->http_port();
  const int declared_only = ConnectLoopback(port);
  ASSERT_GE(declared_only, 0);
  const std::string promise =
      "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 900000\r\n\r\n";
  ASSERT_EQ(SendAll(declared_only, promise), promise.size());
  const std::string head =
      "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 700000\r\n\r\n";
  const int stalled = ConnectLoopback(port);
  ASSERT_GE(stalled, 0);
  const std::string part = head + std::string(600000, ' ');
  ASSERT_EQ(SendAll(stalled, part), part.size());
  // Sent is not yet read: a body probing the room before the server has read the stalled one
  // would take the room first, and the stalled request would be the one refused.
  constexpr int64_t kOther = 700000;
  const std::string other = head + std::string(kOther, ' ');
  double held = 0;  // the last read of the gauge
  const auto holds = [&] { return held = gauge("attnserve_http_body_bytes"); };
  ASSERT_TRUE(WaitFor([&] { return holds() + kOther > room; })) << "it holds " << held << " bytes";
  // (What it holds of the stalled body, counted in steps of 64 KiB as its bytes arrive.)
  EXPECT_LE(held, 600000 + (64 << 10));
  // Another 700 KB body: 503 (400 once read whole: not JSON). Declared alone, the 900 KB hold
  // nothing: else the stalled body would not fit.
  const std::string refused = RawExchange(port, other, std::chrono::seconds(5));
  EXPECT_EQ(RawStatus(refused), 503) << refused.substr(0, 300);
  EXPECT_NE(refused.find("--http-bodies-mib"), std::string::npos) << refused.substr(0, 300);
  const std::string url = absl::StrCat("http://127.0.0.1:", port, "/v2/models/demo/infer");
  const Call small{{Tensor{"input", "FP32", {1, 2, kWidth}, Wave(2 * kWidth), {}}}};
  const auto [body, headers] = ToRest(small, Form::kNested, /*binary_output=*/false);
  EXPECT_EQ(HttpCall("POST", url, body, headers).status, 200);
  close(stalled);  // its request fails, and gives its room back
  // Read whole (400: not JSON) beside the 900 KB declared and never sent.
  std::string taken;
  EXPECT_TRUE(WaitFor([&] {
    taken = RawExchange(port, other, std::chrono::seconds(1));
    return RawStatus(taken) == 400;
  })) << taken.substr(0, 300);
  // Every body read has given its room back; the declared one never took any.
  EXPECT_TRUE(WaitFor([&] { return holds() == 0; })) << "it holds " << held << " bytes";
  close(declared_only);
}

// Writes a token file and returns its path.
std::string TokenFile(const std::string& name, const std::string& token) {
  const std::string path = TempPath(name);
  std::ofstream(path) << token << "\n";
  return path;
}

TEST(HttpSecurityTest, BearerTokensGuardEverythingButHealth) {
  ServerOptions options = DemoOptions();
  options.auth_token_file = TokenFile("http-tokens", "s3cret");
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string base = absl::StrCat("http://127.0.0.1:", server->http_port());
  EXPECT_EQ(HttpCall("GET", base + "/v2/health/ready").status, 200);
  EXPECT_EQ(HttpCall("GET", base + "/v2/health/live").status, 200);
  // Only those two paths: not another path that begins like them, however it is written.
  EXPECT_EQ(HttpCall("GET", base + "/v2/health/%2e%2e/models/demo").status, 401);
  EXPECT_EQ(HttpCall("POST", base + "/v2/health/%2E%2E/models/demo/infer", SmallCall(), {}).status,
            401);
  EXPECT_EQ(HttpCall("GET", base + "/v2").status, 401);
  EXPECT_EQ(HttpCall("GET", base + "/v2", "", {"Authorization: Bearer wrong"}).status, 401);
  EXPECT_EQ(HttpCall("GET", base + "/v2", "", {"Authorization: s3cret"}).status, 401);
  EXPECT_EQ(HttpCall("POST", base + "/v2/models/demo/infer", SmallCall(), {}).status, 401);
  EXPECT_EQ(HttpCall("GET", base + "/v2", "", {"Authorization: Bearer s3cret"}).status, 200);
  EXPECT_EQ(HttpCall("POST", base + "/v2/models/demo/infer", SmallCall(),
                     {"Authorization: Bearer s3cret"})
                .status,
            200);
}

HttpTls Trusting(const std::string& ca_path) {
  HttpTls tls;
  tls.ca_path = ca_path;
  return tls;
}

TEST(HttpSecurityTest, TlsAndMutualTlsWithTheMainPortsFiles) {
  absl::StatusOr<test::Certificates> certs = test::MakeCertificates(TempPath("http-certs"));
  ASSERT_TRUE(certs.ok()) << certs.status();
  ServerOptions options = DemoOptions();
  options.tls.cert = certs->server_cert_path;
  options.tls.key = certs->server_key_path;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string https = absl::StrCat("https://127.0.0.1:", server->http_port());
  const HttpTls trust = Trusting(certs->ca_path);
  EXPECT_EQ(HttpCall("GET", https + "/v2/health/ready", "", {}, trust).status, 200);
  EXPECT_EQ(HttpCall("POST", https + "/v2/models/demo/infer", SmallCall(), {}, trust).status, 200);
  EXPECT_EQ(HttpCall("GET", https + "/v2").status, 0);  // an unknown CA
  EXPECT_EQ(HttpCall("GET", absl::StrCat("http://127.0.0.1:", server->http_port(), "/v2")).status,
            0);  // plaintext to a TLS port gets no HTTP answer
  server.reset();

  options.tls.client_ca = certs->ca_path;
  server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string mtls = absl::StrCat("https://127.0.0.1:", server->http_port(), "/v2");
  EXPECT_EQ(HttpCall("GET", mtls, "", {}, trust).status, 0);  // no client certificate
  const HttpTls client{certs->ca_path, certs->client_cert_path, certs->client_key_path};
  EXPECT_EQ(HttpCall("GET", mtls, "", {}, client).status, 200);
}

TEST(HttpSecurityTest, ARotatedCertificateIsServedWithoutRestart) {
  absl::StatusOr<test::Certificates> first = test::MakeCertificates(TempPath("rot-a"), "ca-a");
  absl::StatusOr<test::Certificates> next = test::MakeCertificates(TempPath("rot-b"), "ca-b");
  ASSERT_TRUE(first.ok() && next.ok());
  const std::string cert = TempPath("rot-cert.pem"), key = TempPath("rot-key.pem");
  std::filesystem::copy_file(first->server_cert_path, cert);
  std::filesystem::copy_file(first->server_key_path, key);
  ServerOptions options = DemoOptions();
  options.tls.cert = cert;
  options.tls.key = key;
  options.tls.refresh_seconds = 1;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const std::string url = absl::StrCat("https://127.0.0.1:", server->http_port(), "/v2");
  EXPECT_EQ(HttpCall("GET", url, "", {}, Trusting(first->ca_path)).status, 200);
  std::filesystem::copy_file(next->server_cert_path, cert,
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(next->server_key_path, key,
                             std::filesystem::copy_options::overwrite_existing);
  int status = 0;
  for (int i = 0; i < 40 && status != 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    status = HttpCall("GET", url, "", {}, Trusting(next->ca_path)).status;
  }
  EXPECT_EQ(status, 200);
}

TEST(HttpDrainTest, NotReadyAndUnavailableWhileDraining) {
  std::unique_ptr<Server> server = StartServer(DemoOptions());
  ASSERT_NE(server, nullptr);
  const std::string base = absl::StrCat("http://127.0.0.1:", server->http_port());
  server->Drain(std::chrono::seconds(1), std::chrono::milliseconds(0));
  EXPECT_EQ(HttpCall("GET", base + "/v2/health/live").status, 200);
  EXPECT_EQ(HttpCall("GET", base + "/v2/health/ready").status, 400);
  EXPECT_EQ(HttpCall("GET", base + "/v2/models/demo/ready").status, 400);
  const HttpReply infer = HttpCall("POST", base + "/v2/models/demo/infer", SmallCall(), {});
  EXPECT_EQ(infer.status, 503);
  ASSERT_TRUE(infer.headers.contains("connection"));
  EXPECT_EQ(infer.headers.at("connection"), "close");
}

// The malformed-HTTP suite: each answered 4xx (or the connection closed), never a crash or a
// hang, and the server serves afterwards.
TEST_F(HttpTest, MalformedHttpIsRefusedAndTheServerGoesOn) {
  const int port = server_->http_port();
  const std::string infer = "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"garbage request line", "GARBAGE\r\n\r\n"},
      {"binary noise", std::string("\x00\xff\x16\x03\x01 \r\n\r\n", 10)},
      {"no version", "GET /v2\r\n\r\n"},
      {"huge header", "GET /v2 HTTP/1.1\r\nX-Big: " + std::string(64 << 10, 'a') + "\r\n\r\n"},
      {"many headers",
       [] {
         std::string r = "GET /v2 HTTP/1.1\r\n";
         for (int i = 0; i < 100; ++i) r += absl::StrCat("X-", i, ": a\r\n");
         return r + "\r\n";
       }()},
      {"chunk size not hex", infer + "Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"},
      {"chunk shorter than its size",
       infer + "Transfer-Encoding: chunked\r\n\r\n10\r\nabc\r\n0\r\n\r\n"},
      {"negative length", infer + "Content-Length: -5\r\n\r\n{}"},
      {"invalid UTF-8 in JSON", infer + "Content-Length: 16\r\n\r\n{\"id\":\"\xc3\x28\xff\"}  "},
      {"both lengths",
       infer + "Transfer-Encoding: chunked\r\nContent-Length: 7\r\n\r\n2\r\n{}\r\n0\r\n\r\n"},
  };
  for (const auto& [name, bytes] : cases) {
    const std::string answer = RawExchange(port, bytes, std::chrono::seconds(5),
                                           /*close_write=*/true);
    const int status = RawStatus(answer);
    EXPECT_TRUE(status == 0 || (status >= 400 && status < 500)) << name << ": " << answer;
    // Answered as every error of the port is, the library's own refusals too.
    if (status != 0) {
      EXPECT_NE(answer.find("{\"error\":"), std::string::npos) << name << ": " << answer;
    }
  }
  // Refused for having both lengths, not for what either would make of the body.
  const std::string both = RawExchange(port, cases.back().second);
  EXPECT_EQ(RawStatus(both), 400);
  EXPECT_NE(both.find("both Transfer-Encoding and Content-Length"), std::string::npos) << both;
  // A body shorter than its Content-Length, then the client stops sending.
  EXPECT_EQ(RawStatus(RawExchange(port, infer + "Content-Length: 100\r\n\r\n{}",
                                  std::chrono::seconds(5), /*close_write=*/true)),
            400);
  // A body longer than its Content-Length: the rest is the next request, and malformed.
  const std::string longer =
      RawExchange(port, infer + "Content-Length: 2\r\n\r\n{}GARBAGE\r\n\r\n");
  EXPECT_EQ(RawStatus(longer), 400);
  EXPECT_NE(longer.find("400 Bad Request", 20), std::string::npos) << longer;
  EXPECT_EQ(HttpCall("GET", Url("/v2/health/ready")).status, 200);
  EXPECT_EQ(Infer(SmallCall(), {}).status, 200);
}

// A Content-Length that another server could read otherwise (a list, hex, a fraction, trailing
// text, two headers) is refused 400 and its connection closed: the bytes after it, here a whole
// request, are never answered as one (request smuggling through a proxy in front).
TEST_F(HttpTest, AnAmbiguousContentLengthIsRefusedAndWhatFollowsIsNeverARequest) {
  const int port = server_->http_port();
  const std::string inner = "GET /v2/models/demo HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string length = std::to_string(inner.size());
  for (const std::string& header : std::vector<std::string>{
           "Content-Length: 0, " + length, "Content-Length: 0x29", "Content-Length: 0abc",
           "Content-Length: 1e2", "Content-Length: 5.0",
           "Content-Length: 0\r\nContent-Length: " + length,
           "Content-Length: 0\r\nContent-Length: 0"}) {
    const std::string answer = RawExchange(
        port, "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n" + header + "\r\n\r\n" + inner,
        std::chrono::seconds(5), /*close_write=*/true);
    EXPECT_EQ(RawStatus(answer), 400) << header << ": " << answer;
    EXPECT_NE(answer.find("Content-Length"), std::string::npos) << header << ": " << answer;
    EXPECT_EQ(answer.find("HTTP/1.1", 1), std::string::npos)
        << header << ": a second answer: " << answer;
  }
  // A plain length still frames its body (a space after it allowed), and keep-alive serves the
  // request after it.
  const std::string two = RawExchange(
      port,
      "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2 \r\n\r\n{}" + inner,
      std::chrono::seconds(5), /*close_write=*/true);
  EXPECT_EQ(RawStatus(two), 400) << two;
  EXPECT_NE(two.find("200 OK"), std::string::npos) << two;
}

// Sends `prefix` at once, then `trickle` a byte every `gap` on one connection, until the
// server answers or closes it (or `give_up` passes); how long that took.
std::chrono::milliseconds TrickleUntilAnswered(int port, const std::string& prefix,
                                               const std::string& trickle,
                                               std::chrono::milliseconds gap,
                                               std::chrono::milliseconds give_up) {
  const auto start = std::chrono::steady_clock::now();
  const int fd = ConnectLoopback(port);
  EXPECT_GE(fd, 0);
  send(fd, prefix.data(), prefix.size(), MSG_NOSIGNAL);
  for (char c : trickle) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 0) > 0) break;  // an answer, or the connection closed
    if (send(fd, &c, 1, MSG_NOSIGNAL) != 1) break;
    if (std::chrono::steady_clock::now() - start > give_up) break;
    std::this_thread::sleep_for(gap);
  }
  close(fd);
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start);
}

TEST(HttpSlowClientTest, ByteByByteHeadersAndBodiesAndIdleConnectionsAreCutOff) {
  ServerOptions options = DemoOptions();
  options.http_header_timeout_ms = 1000;
  options.http_body_timeout_ms = 1000;
  options.http_idle_timeout_ms = 1000;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const int port = server->http_port();
  const std::string headers = "GET /v2 HTTP/1.1\r\nX-Slow: " + std::string(200, 'a');
  EXPECT_LT(TrickleUntilAnswered(port, "", headers, std::chrono::milliseconds(50),
                                 std::chrono::seconds(8)),
            std::chrono::seconds(4));
  // The body's time counts from its first byte: a 400 comes once it is over.
  EXPECT_LT(TrickleUntilAnswered(
                port, "POST /v2/models/demo/infer HTTP/1.1\r\nContent-Length: 300\r\n\r\n",
                std::string(300, ' '), std::chrono::milliseconds(20), std::chrono::seconds(8)),
            std::chrono::seconds(4));
  // An idle keep-alive connection is closed after the idle time.
  const auto start = std::chrono::steady_clock::now();
  const std::string answer =
      RawExchange(port, "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n", std::chrono::seconds(8));
  EXPECT_EQ(RawStatus(answer), 200);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
}

// Sends `prefix`, then a byte every `gap`, reading what comes back, until the server closes the
// connection (or `give_up` passes); how long that took, and the status it answered (0: none).
std::pair<std::chrono::milliseconds, int> TrickleUntilClosed(int port, const std::string& prefix,
                                                             std::chrono::milliseconds gap,
                                                             std::chrono::milliseconds give_up) {
  const auto start = std::chrono::steady_clock::now();
  const int fd = ConnectLoopback(port);
  EXPECT_GE(fd, 0);
  send(fd, prefix.data(), prefix.size(), MSG_NOSIGNAL);
  std::string answer;
  while (std::chrono::steady_clock::now() - start < give_up) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(gap.count())) > 0) {
      char buffer[4096];
      const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) break;  // closed
      answer.append(buffer, n);
      continue;
    }
    if (send(fd, " ", 1, MSG_NOSIGNAL) != 1) break;
  }
  close(fd);
  return {std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                start),
          answer.size() > 12 ? std::atoi(answer.c_str() + 9) : 0};
}

// A body sent a byte at a time just under the per-read timeout, after a fast start or not, is cut
// off once --http-body-timeout has passed (each byte would restart the library's own timeout);
// and a connection answered "Connection: close" (413: the body is too large) is closed, not kept
// while the client goes on sending the body it declared.
TEST(HttpSlowClientTest, ABodyTrickledUnderTheReadTimeoutIsCutOffAtTheBodyTimeout) {
  ServerOptions options = DemoOptions();
  options.http_header_timeout_ms = 1000;
  options.http_body_timeout_ms = 1000;
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const int port = server->http_port();
  const std::string infer = "POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n";
  const auto gap = std::chrono::milliseconds(400);
  const auto give_up = std::chrono::seconds(10);
  const auto [trickled_for, trickled] =
      TrickleUntilClosed(port, infer + "Content-Length: 300\r\n\r\n", gap, give_up);
  EXPECT_LT(trickled_for, std::chrono::seconds(4)) << "a body trickled from its first byte";
  EXPECT_EQ(trickled, 400);
  const auto [fast_then_trickled_for, fast_then_trickled] = TrickleUntilClosed(
      port, infer + "Content-Length: 400000\r\n\r\n" + std::string(200000, ' '), gap, give_up);
  EXPECT_LT(fast_then_trickled_for, std::chrono::seconds(4)) << "a body sent fast, then trickled";
  EXPECT_EQ(fast_then_trickled, 400);
  const auto [closed_after, status] =
      TrickleUntilClosed(port, infer + "Content-Length: 1099511627776\r\n\r\n", gap, give_up);
  EXPECT_EQ(status, 413);
  // Closed after its lingering close (2 s), not kept while the client sends.
  EXPECT_LT(closed_after, std::chrono::seconds(6)) << "the 413's connection was kept open";
  EXPECT_EQ(HttpCall("GET", "http://127.0.0.1:" + std::to_string(port) + "/v2/health/ready").status,
            200);
}

// The REST port a child bound for its --http-listen of port 0, read from its start-up summary
// (logged after the port file is written); 0 when none came within 20 s. (A port picked here and
// closed before the child binds it could be taken by another process meanwhile.)
int ChildHttpPort(const ChildServer& child) {
  constexpr std::string_view kKey = " http_port=";
  int port = 0;
  WaitFor(
      [&] {
        const std::string output = child.Output();
        const size_t at = output.find(kKey);
        // The whole line: a write under way could end in the middle of the number.
        if (at == std::string::npos || output.find('\n', at) == std::string::npos) return false;
        port = std::atoi(output.c_str() + at + kKey.size());
        return true;
      },
      std::chrono::seconds(20));
  return port;
}

// A rolling update over REST: callers keep calling through SIGTERM until the process is gone.
// Each call is answered 200 (computed) or 503 (refused while draining, with Connection: close),
// or finds no server once it exited; never another status.
TEST(HttpDrainTest, EveryCallThroughSigtermIsAnsweredOkOrUnavailable) {
  const std::string port_file = TempPath("http-drain.port");
  // --queue-delay-target-ms 0: no shedding (429), as in ProcessTest.
  ChildServer child({"--listen", "127.0.0.1:0", "--port-file", port_file, "--http-listen",
                     "127.0.0.1:0", "--shutdown-grace", "5", "--queue-delay-target-ms", "0"},
                    TempPath("http-drain.log"));
  ASSERT_GT(child.WaitForPort(port_file, std::chrono::seconds(20)), 0) << child.Output();
  const int http_port = ChildHttpPort(child);
  ASSERT_GT(http_port, 0) << child.Output();
  const std::string url = absl::StrCat("http://127.0.0.1:", http_port, "/v2/models/demo/infer");
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::map<int, int> statuses;
  std::vector<std::thread> callers;
  for (int i = 0; i < 16; ++i) {
    callers.emplace_back([&, i] {
      const std::string body = SmallCall(16 << (i % 3));
      while (!stop.load()) {
        const HttpReply reply = HttpCall("POST", url, body, {"Request-Timeout-Ms: 20000"});
        std::lock_guard lock(mu);
        ++statuses[reply.status];
      }
    });
  }
  // The signal comes once the load runs, however slow the machine.
  WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return statuses[200] > 16;
      },
      std::chrono::seconds(20));
  child.Signal(SIGTERM);
  const int exit_code = child.Wait(std::chrono::seconds(30));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop.store(true);
  for (auto& t : callers) t.join();
  EXPECT_EQ(exit_code, 0) << child.Output();
  EXPECT_GT(statuses[200], 16) << "the load did not run before the signal";
  EXPECT_GT(statuses[503], 0);
  for (const auto& [status, count] : statuses) {
    EXPECT_TRUE(status == 200 || status == 503 || status == 0) << count << " calls got " << status;
  }
}

// A parameter this server reads, given twice, is refused (the last one would win unseen), and so
// is sequence_start or sequence_end without a sequence_id (the flag would be dropped, the call
// served one-shot); unknown keys, however many, are read through at the cost of reading them.
TEST_F(HttpTest, RepeatedParametersAndFlagsWithoutASequenceAreRefused) {
  const std::vector<std::string> json = {"Content-Type: application/json"};
  auto with_parameters = [](const std::string& parameters) {
    Json call = Json::parse(SmallCall());
    call.erase("parameters");
    return absl::StrCat("{\"parameters\":", parameters, ",", call.dump().substr(1));
  };
  ASSERT_EQ(Infer(with_parameters(R"({"kind":"causal"})"), json).status, 200);
  for (const char* parameters :
       {R"({"kind":"causal","kind":"bidirectional"})", R"({"sequence_start":true})",
        R"({"sequence_end":true})", R"({"sequence_id":1,"sequence_id":"1"})"}) {
    const HttpReply reply = Infer(with_parameters(parameters), json);
    EXPECT_EQ(reply.status, 400) << parameters << ": " << reply.body;
  }
  EXPECT_EQ(Infer(with_parameters(R"({"sequence_start":false,"sequence_end":false})"), json).status,
            200);
  // 300,000 keys: a body of 3.4 MB. Each key compared with every one before it took minutes.
  std::string many = "{";
  for (int i = 0; i < 300000; ++i) absl::StrAppend(&many, "\"k", i, "\":0,");
  many += with_parameters(R"({"x":1,"x":2})").substr(1);
  const HttpReply reply = Infer(many, json);
  EXPECT_EQ(reply.status, 200) << reply.error << reply.body.substr(0, 300);
}

// The one CallReporter counts REST calls in the same series as gRPC's.
TEST(HttpMetricsTest, RestAndGrpcCallsAreCountedTogether) {
  ServerOptions options = DemoOptions();
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  const Call call{{Tensor{"input", "FP32", {1, 3, kWidth}, Wave(3 * kWidth), {}}}, "causal"};
  const std::string base = absl::StrCat("http://127.0.0.1:", server->http_port(), "/v2/models/");
  for (int i = 0; i < 2; ++i) {
    const auto [body, headers] = ToRest(call, Form::kFlat);
    ASSERT_EQ(HttpCall("POST", base + "demo/infer", body, headers).status, 200);
  }
  EXPECT_EQ(HttpCall("POST", base + "nope/infer", SmallCall(), {}).status, 404);
  // Sequence steps are a session's messages: counted with the Decode streams', not as calls.
  const std::vector<float> values = Wave(2 * kWidth, 3);
  for (int i = 0; i < 2; ++i) {
    const auto [body, headers] = SequenceStepBody(values, i, 1, "counted", i == 0, i == 1);
    ASSERT_EQ(HttpCall("POST", base + "demo/infer", body, headers).status, 200);
  }
  const auto [ended, step_headers] = SequenceStepBody(values, 0, 1, "counted", false, false);
  EXPECT_EQ(HttpCall("POST", base + "demo/infer", ended, step_headers).status, 404);
  // A step whose body does not decode (an id that is neither an integer nor a string) is still
  // a session's message, as over gRPC: refused as such, not queued and counted as a call.
  const auto [bad_id, _] = SequenceStepBody(values, 0, 1, 1.5, true, false);
  EXPECT_EQ(HttpCall("POST", base + "demo/infer", bad_id, step_headers).status, 400);
  auto stub = inference::GRPCInferenceService::NewStub(Connect(server->port()));
  grpc::ClientContext context;
  ModelInferResponse response;
  ASSERT_TRUE(stub->ModelInfer(&context, ToGrpc(call), &response).ok());
  absl::StatusOr<std::map<std::string, double>> series = Scrape(server->metrics_port());
  ASSERT_TRUE(series.ok()) << series.status();
  // The same series, told apart by protocol; the other metrics count both together.
  EXPECT_EQ((*series)[SeriesKey(
                "attnserve_requests_total",
                {{"model", "demo"}, {"kind", "causal"}, {"code", "OK"}, {"protocol", "http"}})],
            2);
  EXPECT_EQ((*series)[SeriesKey(
                "attnserve_requests_total",
                {{"model", "demo"}, {"kind", "causal"}, {"code", "OK"}, {"protocol", "grpc"}})],
            1);
  EXPECT_EQ((*series)[SeriesKey(
                "attnserve_requests_total",
                {{"model", ""}, {"kind", ""}, {"code", "NOT_FOUND"}, {"protocol", "http"}})],
            1);
  EXPECT_EQ((*series)[SeriesKey("attnserve_request_duration_seconds_count",
                                {{"model", "demo"}, {"kind", "causal"}})],
            3);
  EXPECT_EQ(
      (*series)[SeriesKey("attnserve_session_messages_total", {{"model", "demo"}, {"code", "OK"}})],
      2);
  EXPECT_EQ((*series)[SeriesKey("attnserve_session_messages_total",
                                {{"model", "demo"}, {"code", "NOT_FOUND"}})],
            1);
  EXPECT_EQ((*series)[SeriesKey("attnserve_session_messages_total",
                                {{"model", "demo"}, {"code", "INVALID_ARGUMENT"}})],
            1);
  for (const char* kind : {"", "causal"}) {
    EXPECT_EQ((*series)[SeriesKey("attnserve_requests_total", {{"model", "demo"},
                                                               {"kind", kind},
                                                               {"code", "INVALID_ARGUMENT"},
                                                               {"protocol", "http"}})],
              0)
        << kind;
  }
}

TEST(HttpServerTest, AHandlerThatThrowsFailsItsRequestAndTheOthersGoOn) {
  HttpRouter router;
  router.Add("GET", "/throws", [](HttpExchange&) { throw std::length_error("vector too long"); });
  router.Add("GET", "/ok",
             [](HttpExchange& exchange) { exchange.Reply(200, "text/plain", "fine"); });
  HttpServerOptions options;
  options.listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(std::move(options), std::move(router));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string base = absl::StrCat("http://127.0.0.1:", (*server)->port());

  for (int i = 0; i < 3; ++i) {
    const HttpReply failed = HttpCall("GET", base + "/throws");
    EXPECT_EQ(failed.status, 500) << failed.error;
    EXPECT_NE(failed.body.find("vector too long"), std::string::npos) << failed.body;
    const HttpReply ok = HttpCall("GET", base + "/ok");
    EXPECT_EQ(ok.status, 200) << ok.error;
    EXPECT_EQ(ok.body, "fine");
  }
}

TEST(HttpOptionsTest, OffAndBadAddresses) {
  ServerOptions options = DemoOptions();
  options.http_listen = "off";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->http_port(), 0);
  options.http_listen = "nonsense";
  EXPECT_FALSE(CheckOptions(options).ok());
  options.http_listen = "127.0.0.1:0";
  options.http_max_connections = 0;
  EXPECT_FALSE(CheckOptions(options).ok());
  // Room for the bodies held at once: at least one largest body.
  options.http_max_connections = 16;
  options.max_message_mib = 64;
  options.http_bodies_mib = 63;
  const absl::Status small = CheckOptions(options);
  EXPECT_FALSE(small.ok());
  EXPECT_NE(small.message().find("--max-message-mib"), std::string::npos) << small;
  options.http_bodies_mib = 64;
  EXPECT_TRUE(CheckOptions(options).ok());
  options.http_bodies_mib = 0;
  EXPECT_TRUE(CheckOptions(options).ok());
  EXPECT_GE(HttpBodiesBytes(options), int64_t{64} << 20);
}

}  // namespace
}  // namespace attnserve::server::testing
