// The Open Inference Protocol frontend (inference.GRPCInferenceService) over a real channel to a
// real server, checked against the attnserve.v1 Forward of the same server on the same data:
// every golden case in every layout and encoding (bitwise for FP32), FP16 and BF16 inputs
// (against Forward on the values they round to), requested outputs, metadata and readiness,
// each refusal with its code, and bodies that are not a ModelInferRequest.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/float16.h"
#include "core/layer_spec.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/frontends/oip/infer_codec.h"
#include "server/frontends/v1/forward_codec.h"
#include "tests/common/golden.h"
#include "tests/server/scrape.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

// The compiler's IEEE half type: gcc and clang >= 15 call it _Float16; clang-14 (the sanitizer
// and fuzz builds) has no _Float16 on x86 but the same conversions as __fp16.
#if defined(__clang__) && __clang_major__ < 15
using Half = __fp16;
#else
using Half = _Float16;
#endif

// The element type a float tensor goes on the wire as.
enum class Wire { kFp32, kFp16, kBf16 };

const char* DatatypeOf(Wire wire) {
  switch (wire) {
    case Wire::kFp16:
      return "FP16";
    case Wire::kBf16:
      return "BF16";
    default:
      return "FP32";
  }
}

// The bfloat16 `value` rounds to (nearest, ties to even), as its bits.
uint16_t ToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// The float32 values `values` take after a trip through `wire` (the compiler's own _Float16
// conversion for FP16, so the test does not reuse the server's).
std::vector<float> Rounded(const std::vector<float>& values, Wire wire) {
  std::vector<float> out(values);
  for (float& v : out) {
    if (wire == Wire::kFp16) v = static_cast<float>(static_cast<Half>(v));
    if (wire == Wire::kBf16) v = std::bit_cast<float>(static_cast<uint32_t>(ToBf16(v)) << 16);
  }
  return out;
}

// Adds float tensor `name` to `request`, as raw bytes or typed fp32_contents.
void AddFloats(const std::string& name, const std::vector<int64_t>& shape,
               const std::vector<float>& values, bool raw, Wire wire, ModelInferRequest* request) {
  auto* tensor = request->add_inputs();
  tensor->set_name(name);
  tensor->set_datatype(DatatypeOf(wire));
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  if (!raw) {
    tensor->mutable_contents()->mutable_fp32_contents()->Assign(values.begin(), values.end());
    return;
  }
  std::string* bytes = request->add_raw_input_contents();
  if (wire == Wire::kFp32) {
    bytes->assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    return;
  }
  std::vector<uint16_t> halves(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    halves[i] = wire == Wire::kFp16 ? std::bit_cast<uint16_t>(static_cast<Half>(values[i]))
                                    : ToBf16(values[i]);
  }
  bytes->assign(reinterpret_cast<const char*>(halves.data()), halves.size() * 2);
}

// Adds INT32 tensor `name` [n] to `request`.
void AddInts(const std::string& name, const google::protobuf::RepeatedField<int32_t>& values,
             bool raw, ModelInferRequest* request) {
  auto* tensor = request->add_inputs();
  tensor->set_name(name);
  tensor->set_datatype("INT32");
  tensor->add_shape(values.size());
  if (raw) {
    request->add_raw_input_contents()->assign(reinterpret_cast<const char*>(values.data()),
                                              values.size() * sizeof(int32_t));
  } else {
    *tensor->mutable_contents()->mutable_int_contents() = values;
  }
}

// The ModelInfer request that asks what `forward` asks, its float tensors sent as `wire`.
ModelInferRequest ToInfer(const v1::ForwardRequest& forward, bool raw, Wire wire = Wire::kFp32) {
  ModelInferRequest request;
  request.set_model_name(forward.model());
  request.set_id("call-" + forward.model());
  const auto kind = KindFromProto(forward.kind());
  (*request.mutable_parameters())["kind"].set_string_param(std::string(core::KindName(*kind)));
  (*request.mutable_parameters())["return_attention"].set_bool_param(forward.return_attention());
  auto shape = [](const v1::Tensor& t) {
    return std::vector<int64_t>(t.shape().begin(), t.shape().end());
  };
  AddFloats("input", shape(forward.input()), TensorValues(forward.input()), raw, wire, &request);
  if (!forward.lengths().empty()) AddInts("lengths", forward.lengths(), raw, &request);
  if (forward.has_context()) {
    AddFloats("context", shape(forward.context()), TensorValues(forward.context()), raw, wire,
              &request);
  }
  if (!forward.context_lengths().empty()) {
    AddInts("context_lengths", forward.context_lengths(), raw, &request);
  }
  return request;
}

// `forward` with its float tensors replaced by the values they take through `wire`.
v1::ForwardRequest RoundedForward(v1::ForwardRequest forward, Wire wire) {
  auto round = [wire](v1::Tensor* t) {
    const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
    *t = MakeTensor(shape, Rounded(TensorValues(*t), wire), !t->raw().empty());
  };
  round(forward.mutable_input());
  if (forward.has_context()) round(forward.mutable_context());
  return forward;
}

// The floats of output `name` of `response` (raw or typed), and its shape; nullopt if absent.
std::optional<std::pair<std::vector<int64_t>, std::vector<float>>> Output(
    const ModelInferResponse& response, const std::string& name) {
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& tensor = response.outputs(i);
    if (tensor.name() != name) continue;
    std::vector<float> values;
    if (response.raw_output_contents_size() > 0) {
      const std::string& bytes = response.raw_output_contents(i);
      values.resize(bytes.size() / sizeof(float));
      std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
    } else {
      values.assign(tensor.contents().fp32_contents().begin(),
                    tensor.contents().fp32_contents().end());
    }
    return std::make_pair(std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()),
                          values);
  }
  return std::nullopt;
}

// Empty when ModelInfer's output `name` has v1 tensor `expected`'s shape and the very same bits.
std::string SameBits(const ModelInferResponse& response, const std::string& name,
                     const v1::Tensor& expected) {
  const auto got = Output(response, name);
  if (!got) return name + " missing";
  const std::vector<int64_t> shape(expected.shape().begin(), expected.shape().end());
  if (got->first != shape) return name + ": shapes differ";
  const std::vector<float> want = TensorValues(expected);
  if (got->second.size() != want.size()) return name + ": sizes differ";
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::bit_cast<uint32_t>(got->second[i]) != std::bit_cast<uint32_t>(want[i])) {
      return name + ": element " + std::to_string(i) + " is " + std::to_string(got->second[i]) +
             ", Forward gave " + std::to_string(want[i]);
    }
  }
  return "";
}

class InferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto cases = test::LoadGoldenCases();
    ASSERT_TRUE(cases.ok()) << cases.status();
    cases_ = new std::vector<test::GoldenCase>(*std::move(cases));
    server_ = StartServer(GoldenServerOptions(*cases_)).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete cases_;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    channel_ = Connect(server_->port());
    v1_ = v1::AttentionService::NewStub(channel_);
    v2_ = inference::GRPCInferenceService::NewStub(channel_);
  }

  v1::ForwardResponse Forward(const v1::ForwardRequest& request) {
    v1::ForwardResponse response;
    grpc::ClientContext context;
    const grpc::Status status = v1_->Forward(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  grpc::Status Infer(const ModelInferRequest& request, ModelInferResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return v2_->ModelInfer(&context, request, response);
  }

  static std::vector<test::GoldenCase>* cases_;
  static Server* server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> v1_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> v2_;
};

std::vector<test::GoldenCase>* InferenceTest::cases_ = nullptr;
Server* InferenceTest::server_ = nullptr;

TEST_F(InferenceTest, EveryCaseInEveryLayoutAndEncodingEqualsForwardBitwise) {
  std::vector<core::AttentionKind> kinds;
  int calls = 0;
  for (const test::GoldenCase& c : *cases_) {
    for (Encoding encoding : {Encoding{false, false}, Encoding{false, true}, Encoding{true, false},
                              Encoding{true, true}}) {
      SCOPED_TRACE(c.name + (encoding.packed ? " packed" : " padded") +
                   (encoding.raw ? " raw" : " typed"));
      const v1::ForwardRequest forward = GoldenRequest(c, encoding, c.has_probabilities());
      const v1::ForwardResponse expected = Forward(forward);
      ModelInferResponse response;
      const grpc::Status status = Infer(ToInfer(forward, encoding.raw), &response);
      ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
      EXPECT_EQ(response.id(), "call-" + forward.model());
      EXPECT_EQ(response.model_name(), forward.model());
      // The reply comes in the request's encoding, FP32.
      EXPECT_EQ(response.raw_output_contents_size() > 0, encoding.raw);
      EXPECT_EQ(response.outputs_size(), c.has_probabilities() ? 2 : 1);
      for (const auto& output : response.outputs()) EXPECT_EQ(output.datatype(), "FP32");
      EXPECT_EQ(SameBits(response, "output", expected.output()), "");
      if (c.has_probabilities()) {
        EXPECT_EQ(SameBits(response, "attention", expected.attention()), "");
      }
      kinds.push_back(c.kind);
      ++calls;
    }
  }
  EXPECT_GE(calls, 4 * 40);
  for (core::AttentionKind kind : core::kAttentionKinds) {
    EXPECT_NE(std::find(kinds.begin(), kinds.end(), kind), kinds.end()) << core::KindName(kind);
  }
}

TEST_F(InferenceTest, HalfPrecisionInputsEqualForwardOnTheirRoundedValues) {
  int checked = 0;
  for (const test::GoldenCase& c : *cases_) {
    for (Wire wire : {Wire::kFp16, Wire::kBf16}) {
      for (bool packed : {false, true}) {
        SCOPED_TRACE(c.name + " " + DatatypeOf(wire) + (packed ? " packed" : " padded"));
        const v1::ForwardRequest forward = GoldenRequest(c, {packed, true}, c.has_probabilities());
        const v1::ForwardResponse expected = Forward(RoundedForward(forward, wire));
        ModelInferResponse response;
        const grpc::Status status = Infer(ToInfer(forward, /*raw=*/true, wire), &response);
        ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
        EXPECT_EQ(response.outputs(0).datatype(), "FP32");
        EXPECT_EQ(SameBits(response, "output", expected.output()), "");
        if (c.has_probabilities()) {
          EXPECT_EQ(SameBits(response, "attention", expected.attention()), "");
        }
        ++checked;
      }
    }
  }
  EXPECT_GE(checked, 4 * 40);
}

TEST(InferCodecTest, HalfConversionEqualsTheCompilersForEveryBitPattern) {
  // Independent of the server: the compiler's _Float16 for every one of the 65536 bit patterns.
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    Half half;  // memcpy, not bit_cast: clang-14's __fp16 cannot be a function's result
    const uint16_t pattern = static_cast<uint16_t>(bits);
    std::memcpy(&half, &pattern, sizeof(half));
    const float want = static_cast<float>(half);
    const float got = core::HalfToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << bits;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << bits;
    }
  }
  EXPECT_EQ(core::BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(core::BFloat16ToFloat(0xc040), -3.0f);
}

TEST_F(InferenceTest, OnlyTheRequestedOutputsAreSent) {
  const test::GoldenCase& c = *std::find_if(cases_->begin(), cases_->end(),
                                            [](const auto& g) { return g.has_probabilities(); });
  const v1::ForwardRequest forward = GoldenRequest(c, {false, true}, true);
  const v1::ForwardResponse expected = Forward(forward);
  for (bool raw : {false, true}) {
    SCOPED_TRACE(raw ? "raw" : "typed");
    // Only the attention: asking for it is enough, return_attention unset.
    ModelInferRequest request = ToInfer(forward, raw);
    request.mutable_parameters()->erase("return_attention");
    request.add_outputs()->set_name("attention");
    ModelInferResponse response;
    ASSERT_TRUE(Infer(request, &response).ok());
    ASSERT_EQ(response.outputs_size(), 1);
    EXPECT_EQ(response.raw_output_contents_size(), raw ? 1 : 0);
    EXPECT_EQ(SameBits(response, "attention", expected.attention()), "");
    // Only the output, although return_attention is set.
    request = ToInfer(forward, raw);
    request.add_outputs()->set_name("output");
    ASSERT_TRUE(Infer(request, &response).ok());
    ASSERT_EQ(response.outputs_size(), 1);
    EXPECT_EQ(SameBits(response, "output", expected.output()), "");
    // Both, in the order asked.
    request = ToInfer(forward, raw);
    request.add_outputs()->set_name("attention");
    request.add_outputs()->set_name("output");
    ASSERT_TRUE(Infer(request, &response).ok());
    ASSERT_EQ(response.outputs_size(), 2);
    EXPECT_EQ(response.outputs(0).name(), "attention");
    EXPECT_EQ(SameBits(response, "output", expected.output()), "");
    EXPECT_EQ(SameBits(response, "attention", expected.attention()), "");
  }
}

TEST_F(InferenceTest, ServerMetadataLivenessAndReadiness) {
  grpc::ClientContext c1, c2, c3;
  inference::ServerMetadataResponse metadata;
  ASSERT_TRUE(v2_->ServerMetadata(&c1, {}, &metadata).ok());
  EXPECT_EQ(metadata.name(), "attnserve");
  EXPECT_EQ(metadata.version(), ATTNSERVE_PROJECT_VERSION);
  EXPECT_NE(std::find(metadata.extensions().begin(), metadata.extensions().end(), "parameters"),
            metadata.extensions().end());
  inference::ServerLiveResponse live;
  ASSERT_TRUE(v2_->ServerLive(&c2, {}, &live).ok());
  EXPECT_TRUE(live.live());
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(v2_->ServerReady(&c3, {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
}

TEST_F(InferenceTest, ModelReadyAndMetadataStateTheContract) {
  inference::ModelReadyRequest ready_request;
  ready_request.set_name("query_kv");
  inference::ModelReadyResponse ready;
  grpc::ClientContext c1;
  ASSERT_TRUE(v2_->ModelReady(&c1, ready_request, &ready).ok());
  EXPECT_TRUE(ready.ready());

  inference::ModelMetadataRequest request;
  request.set_name("query_kv");  // d_model 16, d_context 12, 2 heads, output projection
  request.set_version("1");
  inference::ModelMetadataResponse metadata;
  grpc::ClientContext c2;
  ASSERT_TRUE(v2_->ModelMetadata(&c2, request, &metadata).ok());
  EXPECT_EQ(metadata.name(), "query_kv");
  EXPECT_EQ(metadata.platform(), "attnserve_onednn");
  ASSERT_EQ(metadata.versions_size(), 1);
  EXPECT_EQ(metadata.versions(0), "1");
  auto text = [](const auto& tensors) {
    std::string s;
    for (const auto& t : tensors) {
      s += t.name() + ":" + t.datatype() + "[";
      for (int64_t d : t.shape()) s += std::to_string(d) + ",";
      s += "] ";
    }
    return s;
  };
  EXPECT_EQ(text(metadata.inputs()),
            "input:FP32[-1,-1,16,] lengths:INT32[-1,] context:FP32[-1,-1,12,] "
            "context_lengths:INT32[-1,] ");
  EXPECT_EQ(text(metadata.outputs()), "output:FP32[-1,-1,16,] attention:FP32[-1,2,-1,-1,] ");

  for (const auto& [name, version] :
       std::vector<std::pair<std::string, std::string>>{{"nope", ""}, {"query_kv", "2"}}) {
    SCOPED_TRACE(name + " version " + version);
    request.set_name(name);
    request.set_version(version);
    grpc::ClientContext c3, c4;
    EXPECT_EQ(v2_->ModelMetadata(&c3, request, &metadata).error_code(),
              grpc::StatusCode::NOT_FOUND);
    ready_request.set_name(name);
    ready_request.set_version(version);
    EXPECT_EQ(v2_->ModelReady(&c4, ready_request, &ready).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(InferenceTest, HealthAndReflectionListTheService) {
  EXPECT_EQ(HealthCheck(channel_.get(), kInferenceServiceName).value_or(-1), 1);
  auto services = ReflectionServices(channel_.get());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(std::find(services->begin(), services->end(), kInferenceServiceName), services->end());
}

TEST(InferenceDrainTest, NotReadyWhileDraining) {
  ServerOptions options;
  ModelConfig demo;
  demo.name = "demo";
  options.models = {demo};
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto stub = inference::GRPCInferenceService::NewStub(Connect(server->port()));
  // The lame duck keeps gRPC answering after admission stopped accepting.
  std::future<void> shutdown = std::async(std::launch::async, [&server] {
    server->Shutdown(std::chrono::seconds(5), std::chrono::milliseconds(1500));
  });
  bool saw_not_ready = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (!saw_not_ready && std::chrono::steady_clock::now() < until) {
    grpc::ClientContext context;
    inference::ServerReadyResponse ready;
    ASSERT_TRUE(stub->ServerReady(&context, {}, &ready).ok());
    saw_not_ready = !ready.ready();
  }
  ASSERT_TRUE(saw_not_ready);
  grpc::ClientContext c1, c2, c3;
  inference::ModelReadyRequest model;
  model.set_name("demo");
  inference::ModelReadyResponse model_ready;
  ASSERT_TRUE(stub->ModelReady(&c1, model, &model_ready).ok());
  EXPECT_FALSE(model_ready.ready());
  inference::ServerLiveResponse live;
  ASSERT_TRUE(stub->ServerLive(&c2, {}, &live).ok());
  EXPECT_TRUE(live.live());
  ModelInferRequest infer;
  infer.set_model_name("demo");
  ModelInferResponse response;
  EXPECT_EQ(stub->ModelInfer(&c3, infer, &response).error_code(), grpc::StatusCode::UNAVAILABLE);
  shutdown.get();
}

// ---- Refusals -------------------------------------------------------------------------------

constexpr int64_t kDemoWidth = 256;

std::vector<float> Ramp(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.01f * static_cast<float>(i));
  return v;
}

// A valid bidirectional call on the demo layer: input [2, 4, 256], lengths {4, 2}.
ModelInferRequest ValidInfer(bool raw) {
  v1::ForwardRequest forward;
  forward.set_model("demo");
  forward.set_kind(v1::ATTENTION_KIND_BIDIRECTIONAL);
  *forward.mutable_input() = MakeTensor({2, 4, kDemoWidth}, Ramp(2 * 4 * kDemoWidth), false);
  forward.add_lengths(4);
  forward.add_lengths(2);
  return ToInfer(forward, raw);
}

// The same as a cross call with context [2, 3, 256], context lengths {3, 1}.
ModelInferRequest ValidCrossInfer(bool raw) {
  ModelInferRequest r = ValidInfer(raw);
  (*r.mutable_parameters())["kind"].set_string_param("cross");
  google::protobuf::RepeatedField<int32_t> lengths;
  lengths.Add(3);
  lengths.Add(1);
  AddFloats("context", {2, 3, kDemoWidth}, Ramp(2 * 3 * kDemoWidth), raw, Wire::kFp32, &r);
  AddInts("context_lengths", lengths, raw, &r);
  return r;
}

struct BadInfer {
  std::string name;
  std::function<ModelInferRequest()> make;
  grpc::StatusCode code;
  std::string names;  // what the message must name ("" when nothing in particular)
};

std::vector<BadInfer> BadInfers() {
  using grpc::StatusCode;
  auto with = [](std::function<void(ModelInferRequest&)> edit, bool raw = true,
                 bool cross = false) {
    return [edit, raw, cross] {
      ModelInferRequest r = cross ? ValidCrossInfer(raw) : ValidInfer(raw);
      edit(r);
      return r;
    };
  };
  const auto typed = false;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {
      {"unknown model", with([](auto& r) { r.set_model_name("nope"); }), StatusCode::NOT_FOUND,
       "nope"},
      {"unknown version", with([](auto& r) { r.set_model_version("7"); }), StatusCode::NOT_FOUND,
       "7"},
      {"missing input", with([](auto& r) {
         r.mutable_inputs()->DeleteSubrange(0, 1);
         r.mutable_raw_input_contents()->DeleteSubrange(0, 1);
       }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"unknown input name", with([](auto& r) { r.mutable_inputs(1)->set_name("mask"); }),
       StatusCode::INVALID_ARGUMENT, "'mask'"},
      {"input given twice", with([](auto& r) { r.mutable_inputs(1)->set_name("input"); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"input datatype INT64", with([](auto& r) { r.mutable_inputs(0)->set_datatype("INT64"); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"input datatype FP64 typed",
       with([](auto& r) { r.mutable_inputs(0)->set_datatype("FP64"); }, typed),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"input rank 1", with([](auto& r) { r.mutable_inputs(0)->mutable_shape()->Truncate(1); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"input zero dimension", with([](auto& r) { r.mutable_inputs(0)->set_shape(1, 0); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"input shape overflows", with([](auto& r) {
         r.mutable_inputs(0)->set_shape(0, int64_t{1} << 40);
         r.mutable_inputs(0)->set_shape(1, int64_t{1} << 40);
       }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"raw size does not match shape",
       with([](auto& r) { r.mutable_raw_input_contents(0)->resize(2 * 3 * kDemoWidth * 4); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"raw not a multiple of 4",
       with([](auto& r) { r.mutable_raw_input_contents(0)->pop_back(); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"FP16 raw size is FP32's", with([](auto& r) { r.mutable_inputs(0)->set_datatype("FP16"); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"typed count does not match shape",
       with(
           [](auto& r) {
             r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->RemoveLast();
           },
           typed),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"typed FP32 sent as int_contents",
       with(
           [](auto& r) {
             auto* contents = r.mutable_inputs(0)->mutable_contents();
             for (float v : contents->fp32_contents())
               contents->add_int_contents(static_cast<int>(v));
             contents->clear_fp32_contents();
           },
           typed),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"typed FP16 (the protocol has no such contents)",
       with([](auto& r) { r.mutable_inputs(0)->set_datatype("FP16"); }, typed),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"typed input without data",
       with([](auto& r) { r.mutable_inputs(0)->clear_contents(); }, typed),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"both raw and typed",
       with([](auto& r) { r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1.0f); }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"raw for only some inputs",
       with([](auto& r) { r.mutable_raw_input_contents()->RemoveLast(); }),
       StatusCode::INVALID_ARGUMENT, "raw_input_contents"},
      {"lengths datatype FP32", with([](auto& r) { r.mutable_inputs(1)->set_datatype("FP32"); }),
       StatusCode::INVALID_ARGUMENT, "'lengths'"},
      {"lengths rank 2", with([](auto& r) { r.mutable_inputs(1)->add_shape(1); }),
       StatusCode::INVALID_ARGUMENT, "'lengths'"},
      {"lengths raw size does not match shape",
       with([](auto& r) { r.mutable_raw_input_contents(1)->append(4, '\0'); }),
       StatusCode::INVALID_ARGUMENT, "'lengths'"},
      {"lengths shape whose bytes overflow (2^62 INT32, none sent)", with([](auto& r) {
         r.mutable_inputs(1)->set_shape(0, int64_t{1} << 62);
         r.mutable_raw_input_contents(1)->clear();
       }),
       StatusCode::INVALID_ARGUMENT, "'lengths'"},
      {"lengths count is not B", with([](auto& r) {
         r.mutable_inputs(1)->set_shape(0, 3);
         r.mutable_raw_input_contents(1)->append(4, '\0');
       }),
       StatusCode::INVALID_ARGUMENT, "'input'"},
      {"length past S (the layer's check)",
       with([](auto& r) { r.mutable_inputs(1)->mutable_contents()->set_int_contents(1, 5); },
            typed),
       StatusCode::INVALID_ARGUMENT, ""},
      {"NaN in input (the layer's check)",
       with([nan](auto& r) { r.mutable_inputs(0)->mutable_contents()->set_fp32_contents(9, nan); },
            typed),
       StatusCode::INVALID_ARGUMENT, "not finite"},
      {"NaN through FP16", with([](auto& r) {
         r.mutable_inputs(0)->set_datatype("FP16");
         std::string& bytes = *r.mutable_raw_input_contents(0);
         bytes.resize(bytes.size() / 2);
         bytes[20] = '\x00';
         bytes[21] = '\x7e';  // 0x7e00: a quiet NaN
       }),
       StatusCode::INVALID_ARGUMENT, "not finite"},
      {"context_lengths without a context",
       with([](auto& r) { r.mutable_inputs(1)->set_name("context_lengths"); }),
       StatusCode::INVALID_ARGUMENT, "'context_lengths'"},
      {"context width is not d_context (the layer's check)",
       with(
           [](auto& r) {
             r.mutable_inputs(2)->set_shape(2, 128);
             r.mutable_raw_input_contents(2)->resize(2 * 3 * 128 * 4);
           },
           true, true),
       StatusCode::INVALID_ARGUMENT, ""},
      {"context datatype INT32",
       with([](auto& r) { r.mutable_inputs(2)->set_datatype("INT32"); }, true, true),
       StatusCode::INVALID_ARGUMENT, "'context'"},
      {"cross kind without context",
       with([](auto& r) { (*r.mutable_parameters())["kind"].set_string_param("causal_cross"); }),
       StatusCode::INVALID_ARGUMENT, ""},
      {"self kind with a context",
       with([](auto& r) { r.mutable_parameters()->erase("kind"); }, true, true),
       StatusCode::INVALID_ARGUMENT, ""},
      {"unknown kind",
       with([](auto& r) { (*r.mutable_parameters())["kind"].set_string_param("sideways"); }),
       StatusCode::INVALID_ARGUMENT, "sideways"},
      {"kind not a string",
       with([](auto& r) { (*r.mutable_parameters())["kind"].set_int64_param(2); }),
       StatusCode::INVALID_ARGUMENT, "kind"},
      {"return_attention not a bool",
       with([](auto& r) { (*r.mutable_parameters())["return_attention"].set_string_param("yes"); }),
       StatusCode::INVALID_ARGUMENT, "return_attention"},
      {"unknown requested output", with([](auto& r) { r.add_outputs()->set_name("logits"); }),
       StatusCode::INVALID_ARGUMENT, "'logits'"},
      {"output requested twice", with([](auto& r) {
         r.add_outputs()->set_name("output");
         r.add_outputs()->set_name("output");
       }),
       StatusCode::INVALID_ARGUMENT, "'output'"},
  };
}

class InferRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    ModelConfig demo;
    demo.name = "demo";
    options.models = {demo};
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
    channel_ = Connect(server_->port());
    stub_ = inference::GRPCInferenceService::NewStub(channel_);
  }

  grpc::Status Call(const ModelInferRequest& request, ModelInferResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->ModelInfer(&context, request, response);
  }

  std::unique_ptr<Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(InferRefusalTest, TheValidRequestsAreValid) {
  for (bool raw : {false, true}) {
    ModelInferResponse response;
    ASSERT_TRUE(Call(ValidInfer(raw), &response).ok());
    ASSERT_TRUE(Call(ValidCrossInfer(raw), &response).ok());
    ASSERT_EQ(response.outputs_size(), 1);
    EXPECT_EQ(response.raw_output_contents_size(), raw ? 1 : 0);
  }
}

TEST_F(InferRefusalTest, EachGetsItsStatusNamingTheTensorAndTheServerKeepsServing) {
  const std::vector<BadInfer> cases = BadInfers();
  for (const BadInfer& c : cases) {
    ModelInferResponse response;
    const grpc::Status status = Call(c.make(), &response);
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << c.name;
    EXPECT_NE(status.error_message().find(c.names), std::string::npos)
        << c.name << ": " << status.error_message();
  }
  EXPECT_EQ(HealthCheck(channel_.get(), kInferenceServiceName).value_or(-1), 1);
  ModelInferResponse response;
  EXPECT_TRUE(Call(ValidInfer(true), &response).ok());
}

// A client's string comes back in a message at most ~100 bytes long, whatever its length: a
// whole 100,000-byte kind would overflow the caller's metadata limit and turn the answer into a
// RESOURCE_EXHAUSTED of the client's own making.
TEST_F(InferRefusalTest, HugeClientStringsAreQuotedShort) {
  const std::string huge(100'000, 'k');
  std::vector<ModelInferRequest> requests(4, ValidInfer(true));
  (*requests[0].mutable_parameters())["kind"].set_string_param(huge);
  requests[1].mutable_inputs(0)->set_datatype(huge);
  requests[2].add_outputs()->set_name(huge);
  requests[3].set_model_version(huge);
  for (const ModelInferRequest& request : requests) {
    ModelInferResponse response;
    const grpc::Status status = Call(request, &response);
    EXPECT_TRUE(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
                status.error_code() == grpc::StatusCode::NOT_FOUND)
        << status.error_code() << ": " << status.error_message().substr(0, 200);
    EXPECT_LT(status.error_message().size(), 400u) << status.error_message().substr(0, 200);
    EXPECT_NE(status.error_message().find("100000 bytes"), std::string::npos)
        << status.error_message();
  }
}

TEST_F(InferRefusalTest, BytesThatAreNotAModelInferRequestAreInvalidArgumentWithAMessage) {
  std::string valid;
  ASSERT_TRUE(ValidInfer(true).SerializeToString(&valid));
  ExpectMalformedBodiesRefused(channel_.get(), "/inference.GRPCInferenceService/ModelInfer", valid,
                               "inference.ModelInferRequest");
  ModelInferResponse response;
  EXPECT_TRUE(Call(ValidInfer(false), &response).ok());
}

// The other methods parse their bodies too: gRPC's typed handlers would answer UNIMPLEMENTED
// with no message.
TEST_F(InferRefusalTest, EveryMethodAnswersBytesThatAreNotItsRequestWithAMessage) {
  for (const std::string method :
       {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata"}) {
    std::string reply;
    const grpc::Status status = CallRaw(channel_.get(), "/inference.GRPCInferenceService/" + method,
                                        "\xff\xff\xff\xff", &reply);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_NE(status.error_message().find("not a valid inference." + method + "Request"),
              std::string::npos)
        << method << ": " << status.error_message();
    // An empty body is a valid (empty) request of every one of them.
    EXPECT_TRUE(
        CallRaw(channel_.get(), "/inference.GRPCInferenceService/" + method, "", &reply).ok())
        << method;
  }
}

}  // namespace
}  // namespace attnserve::server::testing

namespace attnserve::server::testing {
namespace {

// Both frontends' calls pass the one reporter: /metrics counts them alike, by model and kind.
TEST(InferenceMetricsTest, CallsFromBothFrontendsAreCountedTogether) {
  ServerOptions options;
  options.metrics_listen = "127.0.0.1:0";
  std::unique_ptr<Server> server = StartServer(options);
  ASSERT_NE(server, nullptr);
  auto channel = Connect(server->port());
  auto v1_stub = v1::AttentionService::NewStub(channel);
  auto v2_stub = inference::GRPCInferenceService::NewStub(channel);
  v1::ForwardRequest forward;
  forward.set_model("demo");
  forward.set_kind(v1::ATTENTION_KIND_CAUSAL);
  std::vector<float> values(2 * 3 * 256);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(0.01f * i);
  *forward.mutable_input() = MakeTensor({2, 3, 256}, values, /*raw=*/true);
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext context;
    v1::ForwardResponse response;
    ASSERT_TRUE(v1_stub->Forward(&context, forward, &response).ok());
  }
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    ModelInferResponse response;
    ASSERT_TRUE(v2_stub->ModelInfer(&context, ToInfer(forward, /*raw=*/true), &response).ok());
  }
  ModelInferRequest unknown = ToInfer(forward, /*raw=*/true);
  unknown.set_model_name("no-such-model");
  grpc::ClientContext context;
  ModelInferResponse response;
  EXPECT_EQ(v2_stub->ModelInfer(&context, unknown, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);

  absl::StatusOr<std::map<std::string, double>> series = Scrape(server->metrics_port());
  ASSERT_TRUE(series.ok()) << series.status();
  const std::string ok =
      SeriesKey("attnserve_requests_total",
                {{"model", "demo"}, {"kind", "causal"}, {"code", "OK"}, {"protocol", "grpc"}});
  const std::string not_found =
      SeriesKey("attnserve_requests_total",
                {{"model", ""}, {"kind", ""}, {"code", "NOT_FOUND"}, {"protocol", "grpc"}});
  EXPECT_EQ((*series)[ok], 5) << ok;
  EXPECT_EQ((*series)[not_found], 1) << not_found;
  EXPECT_EQ((*series)[SeriesKey("attnserve_tokens_total", {{"model", "demo"}, {"kind", "causal"}})],
            5 * 6);
}

}  // namespace
}  // namespace attnserve::server::testing
