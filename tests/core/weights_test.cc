// Tests of the layout loader (LoadLayerWeights), CheckWeights and the demo layer.
#include <cmath>

#include "core/weights.h"
#include "gtest/gtest.h"

namespace attnserve::core {
namespace {

TEST(DemoWeightsTest, HasTheAdvertisedShapeAndPassesItsOwnCheck) {
  const LayerWeights demo = MakeDemoWeights();
  EXPECT_EQ(demo.spec.d_model, 256);
  EXPECT_EQ(demo.spec.num_heads, 4);
  EXPECT_EQ(demo.spec.head_dim, 64);
  EXPECT_TRUE(demo.spec.has_bias);
  EXPECT_TRUE(demo.spec.has_output_projection);
  EXPECT_EQ(demo.spec.layout, WeightLayout::kBuiltIn);
  EXPECT_TRUE(CheckWeights(demo).ok()) << CheckWeights(demo);
}

TEST(DemoWeightsTest, IsDeterministicAndInNnLinearInitRange) {
  const LayerWeights a = MakeDemoWeights();
  const LayerWeights b = MakeDemoWeights();
  EXPECT_EQ(a.w_q, b.w_q);
  EXPECT_EQ(a.b_o, b.b_o);
  const float bound = 1.0f / 16.0f;  // 1/sqrt(256)
  float largest = 0.0f;
  for (float x : a.w_q) largest = std::max(largest, std::fabs(x));
  EXPECT_LE(largest, bound);
  EXPECT_GT(largest, 0.9f * bound);  // actually spread over the range, not all zero
  EXPECT_NE(a.w_q, a.w_k);
}

TEST(CheckWeightsTest, RefusesWrongSizesAndNonFiniteValues) {
  LayerWeights w = MakeDemoWeights();
  w.w_k.pop_back();
  EXPECT_EQ(CheckWeights(w).code(), absl::StatusCode::kInvalidArgument);

  w = MakeDemoWeights();
  w.b_v.clear();  // has_bias says it must be there
  EXPECT_EQ(CheckWeights(w).code(), absl::StatusCode::kInvalidArgument);

  w = MakeDemoWeights();
  w.w_o[3] = std::nanf("");
  EXPECT_EQ(CheckWeights(w).code(), absl::StatusCode::kInvalidArgument);

  w = MakeDemoWeights();
  w.spec.num_heads = 0;
  EXPECT_EQ(CheckWeights(w).code(), absl::StatusCode::kInvalidArgument);

  w = MakeDemoWeights();
  w.spec.has_output_projection = false;  // then w_o must be empty
  EXPECT_EQ(CheckWeights(w).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve::core
