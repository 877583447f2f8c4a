// The service against PyTorch's golden fixtures, over a real channel to a real server serving
// every fixture's weights file at once (the multi-model case), plus ListModels, health and
// reflection.

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/common/golden.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

class GoldenServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto cases = test::LoadGoldenCases();
    ASSERT_TRUE(cases.ok()) << cases.status();
    cases_ = new std::vector<test::GoldenCase>(*std::move(cases));
    ServerOptions options = GoldenServerOptions(*cases_);
    ModelConfig bf16;  // the same weights as fused_mh, with bf16 matmuls
    bf16.name = "fused_mh_bf16";
    bf16.path = test::FixturesDir() + "/w_fused_mh.safetensors";
    bf16.precision = core::Precision::kBF16;
    options.models.push_back(bf16);
    server_ = StartServer(options).release();
  }
  static void TearDownTestSuite() {
    delete server_;
    delete cases_;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = v1::AttentionService::NewStub(Connect(server_->port()));
  }

  static std::vector<test::GoldenCase>* cases_;
  static Server* server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

std::vector<test::GoldenCase>* GoldenServiceTest::cases_ = nullptr;
Server* GoldenServiceTest::server_ = nullptr;

TEST_F(GoldenServiceTest, EveryCaseInEveryLayoutAndEncodingMatchesPyTorch) {
  int calls = 0;
  for (const test::GoldenCase& c : *cases_) {
    for (Encoding encoding : {Encoding{false, false}, Encoding{false, true}, Encoding{true, false},
                              Encoding{true, true}}) {
      SCOPED_TRACE(c.name + (encoding.packed ? " packed" : " padded") +
                   (encoding.raw ? " raw" : " values"));
      v1::ForwardResponse response;
      grpc::ClientContext context;
      const grpc::Status status =
          stub_->Forward(&context, GoldenRequest(c, encoding, c.has_probabilities()), &response);
      ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
      EXPECT_EQ(response.has_attention(), c.has_probabilities());
      EXPECT_EQ(CompareToGolden(c, encoding, response), "");
      ++calls;
    }
  }
  EXPECT_GE(calls, 4 * 40);
}

TEST_F(GoldenServiceTest, EveryKindIsCovered) {
  std::vector<core::AttentionKind> kinds;
  for (const test::GoldenCase& c : *cases_) kinds.push_back(c.kind);
  for (core::AttentionKind kind :
       {core::AttentionKind::kBidirectional, core::AttentionKind::kCausal,
        core::AttentionKind::kCross, core::AttentionKind::kCausalCross}) {
    EXPECT_NE(std::find(kinds.begin(), kinds.end(), kind), kinds.end());
  }
}

TEST_F(GoldenServiceTest, NoAttentionUnlessAsked) {
  const test::GoldenCase& c = cases_->front();
  v1::ForwardResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->Forward(&context, GoldenRequest(c, {}, false), &response).ok());
  EXPECT_FALSE(response.has_attention());
  EXPECT_EQ(CompareToGolden(c, {}, response), "");
}

TEST_F(GoldenServiceTest, Bf16PrecisionStaysNearPyTorch) {
  int checked = 0;
  for (const test::GoldenCase& c : *cases_) {
    if (GoldenModelName(c) != "fused_mh") continue;
    SCOPED_TRACE(c.name);
    v1::ForwardRequest request = GoldenRequest(c, {true, true}, false);
    request.set_model("fused_mh_bf16");
    v1::ForwardResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Forward(&context, request, &response).ok());
    // bf16 keeps 8 mantissa bits: the core's bf16 tests use the same allclose(2e-2).
    EXPECT_EQ(CompareToGolden(c, {true, true}, response, 2e-2f), "");
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

TEST_F(GoldenServiceTest, ListModelsDescribesEveryModel) {
  v1::ListModelsResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->ListModels(&context, v1::ListModelsRequest(), &response).ok());
  EXPECT_EQ(response.models_size(), static_cast<int>(GoldenModels(*cases_).size()) + 2);
  bool saw_query_kv = false, saw_fused = false, saw_demo = false;
  for (const v1::ModelInfo& m : response.models()) {
    if (m.name() == "query_kv") {
      saw_query_kv = true;
      EXPECT_EQ(m.layout(), "query_kv");
      EXPECT_EQ(m.d_model(), 16);
      EXPECT_EQ(m.d_context(), 12);
      EXPECT_EQ(m.num_heads(), 2);
      EXPECT_TRUE(m.has_output_projection());
      ASSERT_EQ(m.kinds_size(), 2);  // cross only: keys cannot come from a 16-wide input
      EXPECT_EQ(m.kinds(0), v1::ATTENTION_KIND_CROSS);
      EXPECT_EQ(m.kinds(1), v1::ATTENTION_KIND_CAUSAL_CROSS);
      EXPECT_NE(m.source().find("w_query_kv.safetensors"), std::string::npos);
    } else if (m.name() == "fused_mh") {
      saw_fused = true;
      EXPECT_EQ(m.layout(), "fused_qkv");
      EXPECT_EQ(m.num_heads(), 4);
      EXPECT_EQ(m.head_dim(), 4);
      EXPECT_TRUE(m.has_bias());
      EXPECT_EQ(m.precision(), "f32");
      EXPECT_EQ(m.kinds_size(), 4);
    } else if (m.name() == "fused_mh_bf16") {
      EXPECT_EQ(m.precision(), "bf16");
    } else if (m.name() == "demo") {
      saw_demo = true;
      EXPECT_EQ(m.source(), "built-in");
      EXPECT_EQ(m.d_model(), 256);
      EXPECT_EQ(m.num_heads(), 4);
    }
  }
  EXPECT_TRUE(saw_query_kv && saw_fused && saw_demo);
}

TEST_F(GoldenServiceTest, HealthIsServingOverallAndForTheService) {
  auto channel = Connect(server_->port());
  EXPECT_EQ(HealthCheck(channel.get(), "").value_or(-1), 1);
  EXPECT_EQ(HealthCheck(channel.get(), kServiceName).value_or(-1), 1);
  EXPECT_EQ(HealthCheck(channel.get(), "no.such.Service").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(GoldenServiceTest, ReflectionListsTheService) {
  auto channel = Connect(server_->port());
  auto services = ReflectionServices(channel.get());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(std::find(services->begin(), services->end(), kServiceName), services->end());
  EXPECT_NE(std::find(services->begin(), services->end(), "grpc.health.v1.Health"),
            services->end());
}

}  // namespace
}  // namespace attnserve::server::testing
