// Malformed requests: each gets its status code (never a crash or a hang), and the server
// keeps serving afterwards.

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/common/golden.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

constexpr int64_t kDemoWidth = 256;

std::vector<float> Ramp(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.01f * static_cast<float>(i));
  return v;
}

// A valid bidirectional call on the demo layer: input [2, 4, 256], lengths {4, 2}.
v1::ForwardRequest ValidRequest() {
  v1::ForwardRequest r;
  r.set_model("demo");
  r.set_kind(v1::ATTENTION_KIND_BIDIRECTIONAL);
  *r.mutable_input() = MakeTensor({2, 4, kDemoWidth}, Ramp(2 * 4 * kDemoWidth), false);
  r.add_lengths(4);
  r.add_lengths(2);
  return r;
}

// A valid cross call on the demo layer: context [2, 3, 256], context lengths {3, 1}.
v1::ForwardRequest ValidCrossRequest() {
  v1::ForwardRequest r = ValidRequest();
  r.set_kind(v1::ATTENTION_KIND_CROSS);
  *r.mutable_context() = MakeTensor({2, 3, kDemoWidth}, Ramp(2 * 3 * kDemoWidth), true);
  r.add_context_lengths(3);
  r.add_context_lengths(1);
  return r;
}

struct BadCase {
  std::string name;
  std::function<v1::ForwardRequest()> make;
  grpc::StatusCode code;
};

std::vector<BadCase> BadCases() {
  using grpc::StatusCode;
  auto with = [](std::function<void(v1::ForwardRequest&)> edit, bool cross = false) {
    return [edit, cross] {
      v1::ForwardRequest r = cross ? ValidCrossRequest() : ValidRequest();
      edit(r);
      return r;
    };
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  return {
      {"unknown model", with([](auto& r) { r.set_model("nope"); }), StatusCode::NOT_FOUND},
      // Echoed in full, 64 KiB would pass gRPC's 8 KiB metadata limit: RESOURCE_EXHAUSTED.
      {"unknown model with a huge name",
       with([](auto& r) { r.set_model(std::string(1 << 16, 'm')); }), StatusCode::NOT_FOUND},
      {"empty model with several loaded", with([](auto& r) { r.clear_model(); }),
       StatusCode::INVALID_ARGUMENT},
      {"kind unspecified", with([](auto& r) { r.set_kind(v1::ATTENTION_KIND_UNSPECIFIED); }),
       StatusCode::INVALID_ARGUMENT},
      {"kind unknown number", with([](auto& r) { r.set_kind(static_cast<v1::AttentionKind>(42)); }),
       StatusCode::INVALID_ARGUMENT},
      {"no input", with([](auto& r) { r.clear_input(); }), StatusCode::INVALID_ARGUMENT},
      {"input rank 1", with([](auto& r) {
         r.mutable_input()->mutable_shape()->RemoveLast();
         r.mutable_input()->mutable_shape()->RemoveLast();
       }),
       StatusCode::INVALID_ARGUMENT},
      {"input rank 4", with([](auto& r) { r.mutable_input()->add_shape(1); }),
       StatusCode::INVALID_ARGUMENT},
      {"zero dimension", with([](auto& r) { r.mutable_input()->set_shape(1, 0); }),
       StatusCode::INVALID_ARGUMENT},
      {"negative dimension", with([](auto& r) { r.mutable_input()->set_shape(0, -2); }),
       StatusCode::INVALID_ARGUMENT},
      {"shape overflows int64", with([](auto& r) {
         r.mutable_input()->set_shape(0, int64_t{1} << 40);
         r.mutable_input()->set_shape(1, int64_t{1} << 40);
       }),
       StatusCode::INVALID_ARGUMENT},
      {"both values and raw",
       with([](auto& r) { r.mutable_input()->set_raw(std::string(8 * 1024 * 4, '\0')); }),
       StatusCode::INVALID_ARGUMENT},
      {"neither values nor raw", with([](auto& r) { r.mutable_input()->clear_values(); }),
       StatusCode::INVALID_ARGUMENT},
      {"raw not a multiple of 4", with([](auto& r) {
         r.mutable_input()->clear_values();
         r.mutable_input()->set_raw(std::string(2 * 4 * kDemoWidth * 4 - 2, '\0'));
       }),
       StatusCode::INVALID_ARGUMENT},
      {"raw size does not match shape", with([](auto& r) {
         r.mutable_input()->clear_values();
         r.mutable_input()->set_raw(std::string(2 * 3 * kDemoWidth * 4, '\0'));
       }),
       StatusCode::INVALID_ARGUMENT},
      {"values count does not match shape",
       with([](auto& r) { r.mutable_input()->mutable_values()->RemoveLast(); }),
       StatusCode::INVALID_ARGUMENT},
      {"NaN in values", with([nan](auto& r) { r.mutable_input()->set_values(5, nan); }),
       StatusCode::INVALID_ARGUMENT},
      {"infinity in raw", with([inf](auto& r) {
         std::vector<float> v = Ramp(2 * 4 * kDemoWidth);
         v[100] = -inf;
         *r.mutable_input() = MakeTensor({2, 4, kDemoWidth}, v, true);
       }),
       StatusCode::INVALID_ARGUMENT},
      {"width is not d_model", with([](auto& r) {
         *r.mutable_input() = MakeTensor({2, 4, 128}, Ramp(2 * 4 * 128), false);
       }),
       StatusCode::INVALID_ARGUMENT},
      {"lengths count is not B", with([](auto& r) { r.add_lengths(1); }),
       StatusCode::INVALID_ARGUMENT},
      {"length past S", with([](auto& r) { r.set_lengths(1, 5); }), StatusCode::INVALID_ARGUMENT},
      {"negative length", with([](auto& r) { r.set_lengths(1, -1); }),
       StatusCode::INVALID_ARGUMENT},
      {"packed lengths do not sum to T", with([](auto& r) {
         *r.mutable_input() = MakeTensor({6, kDemoWidth}, Ramp(6 * kDemoWidth), true);
         r.set_lengths(1, 3);
       }),
       StatusCode::INVALID_ARGUMENT},
      {"packed negative length", with([](auto& r) {
         *r.mutable_input() = MakeTensor({6, kDemoWidth}, Ramp(6 * kDemoWidth), true);
         r.set_lengths(0, 8);
         r.set_lengths(1, -2);
       }),
       StatusCode::INVALID_ARGUMENT},
      {"more sequences than a call may hold", with([](auto& r) {
         *r.mutable_input() = MakeTensor({4, kDemoWidth}, Ramp(4 * kDemoWidth), true);
         r.clear_lengths();
         r.add_lengths(4);
         for (int i = 0; i < 1 << 16; ++i) r.add_lengths(0);  // empty, but each one is a sequence
       }),
       StatusCode::INVALID_ARGUMENT},
      {"cross kind without context", with([](auto& r) { r.set_kind(v1::ATTENTION_KIND_CROSS); }),
       StatusCode::INVALID_ARGUMENT},
      {"self kind with a context",
       with([](auto& r) { r.set_kind(v1::ATTENTION_KIND_CAUSAL); }, /*cross=*/true),
       StatusCode::INVALID_ARGUMENT},
      {"context width is not d_context",
       with(
           [](auto& r) {
             *r.mutable_context() = MakeTensor({2, 3, 64}, Ramp(2 * 3 * 64), false);
           },
           true),
       StatusCode::INVALID_ARGUMENT},
      {"context batch is not input batch",
       with(
           [](auto& r) {
             *r.mutable_context() = MakeTensor({3, 3, kDemoWidth}, Ramp(3 * 3 * kDemoWidth), false);
             r.add_context_lengths(2);
           },
           true),
       StatusCode::INVALID_ARGUMENT},
      {"context lengths count is not its batch",
       with([](auto& r) { r.mutable_context_lengths()->RemoveLast(); }, true),
       StatusCode::INVALID_ARGUMENT},
      {"context length past its S", with([](auto& r) { r.set_context_lengths(0, 4); }, true),
       StatusCode::INVALID_ARGUMENT},
      {"NaN in context",
       with(
           [nan](auto& r) {
             std::vector<float> v = Ramp(2 * 3 * kDemoWidth);
             v[7] = nan;
             *r.mutable_context() = MakeTensor({2, 3, kDemoWidth}, v, false);
           },
           true),
       StatusCode::INVALID_ARGUMENT},
      {"context_lengths without a context", with([](auto& r) { r.add_context_lengths(1); }),
       StatusCode::INVALID_ARGUMENT},
      {"self kind on a cross-only model", with([](auto& r) {
         r.set_model("query_kv");
         *r.mutable_input() = MakeTensor({2, 4, 16}, Ramp(2 * 4 * 16), false);
       }),
       StatusCode::INVALID_ARGUMENT},
  };
}

class MalformedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    ModelConfig demo;
    demo.name = "demo";
    ModelConfig cross_only;
    cross_only.name = "query_kv";
    cross_only.path = test::FixturesDir() + "/w_query_kv.safetensors";
    options.models = {demo, cross_only};
    server_ = StartServer(options);
    ASSERT_NE(server_, nullptr);
    channel_ = Connect(server_->port());
    stub_ = v1::AttentionService::NewStub(channel_);
  }

  grpc::Status Call(const v1::ForwardRequest& request, v1::ForwardResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Forward(&context, request, response);
  }

  std::unique_ptr<Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(MalformedTest, TheValidRequestsAreValid) {
  v1::ForwardResponse response;
  ASSERT_TRUE(Call(ValidRequest(), &response).ok());
  ASSERT_TRUE(Call(ValidCrossRequest(), &response).ok());
  EXPECT_EQ(response.output().values_size(), 2 * 4 * kDemoWidth);  // input's encoding: values
}

TEST_F(MalformedTest, EachGetsItsStatusAndTheServerKeepsServing) {
  const std::vector<BadCase> cases = BadCases();
  ASSERT_GE(cases.size(), 20u);
  for (const BadCase& c : cases) {
    v1::ForwardResponse response;
    const grpc::Status status = Call(c.make(), &response);
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << c.name;
  }
  EXPECT_EQ(HealthCheck(channel_.get(), "").value_or(-1), 1);
  EXPECT_EQ(HealthCheck(channel_.get(), kServiceName).value_or(-1), 1);
  v1::ForwardResponse response;
  const grpc::Status status = Call(ValidRequest(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.output().shape_size(), 3);
  for (float v : response.output().values()) ASSERT_TRUE(std::isfinite(v));
}

TEST_F(MalformedTest, BytesThatAreNotAForwardRequestAreInvalidArgumentWithAMessage) {
  std::string valid;
  ASSERT_TRUE(ValidRequest().SerializeToString(&valid));
  ExpectMalformedBodiesRefused(channel_.get(), "/attnserve.v1.AttentionService/Forward", valid,
                               "attnserve.v1.ForwardRequest");
  v1::ForwardResponse response;
  EXPECT_TRUE(Call(ValidRequest(), &response).ok());
}

TEST_F(MalformedTest, BytesThatAreNotAListModelsRequestAreInvalidArgumentWithAMessage) {
  const std::string method = "/attnserve.v1.AttentionService/ListModels";
  std::string reply;
  const grpc::Status status = CallRaw(channel_.get(), method, "\xff\xff\xff\xff", &reply);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("not a valid attnserve.v1.ListModelsRequest"),
            std::string::npos)
      << status.error_message();
  ASSERT_TRUE(CallRaw(channel_.get(), method, "", &reply).ok());
  v1::ListModelsResponse models;
  ASSERT_TRUE(models.ParseFromString(reply));
  std::vector<std::string> names;
  for (const auto& model : models.models()) names.push_back(model.name());
  EXPECT_EQ(names, (std::vector<std::string>{"demo", "query_kv"}));
}

TEST_F(MalformedTest, ANonFiniteValueIsReportedByItsPosition) {
  v1::ForwardRequest request = ValidRequest();
  request.mutable_input()->set_values(kDemoWidth + 5, std::numeric_limits<float>::quiet_NaN());
  v1::ForwardResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("input: element [0, 1, 5] is not finite"),
            std::string::npos)
      << status.error_message();
}

// Finite inputs near float32's limit overflow inside the layer: the call is refused naming the
// sequence, never answered OK with NaN, and a merged neighbour of it is answered as usual.
TEST_F(MalformedTest, AnOutputThatOverflowsFloat32IsRefusedNamingTheSequence) {
  v1::ForwardRequest huge = ValidRequest();
  for (int i = 4 * kDemoWidth; i < 8 * kDemoWidth; ++i) {
    huge.mutable_input()->set_values(i, (i % 2 == 0 ? 3e38f : -3e38f));
  }
  v1::ForwardResponse response;
  const grpc::Status status = Call(huge, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("sequence 1: the output is not finite"), std::string::npos)
      << status.error_message();
  ASSERT_TRUE(Call(ValidRequest(), &response).ok());
  for (float v : response.output().values()) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace attnserve::server::testing
