#include "core/small_matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace attnserve::core {
namespace {

float ValueAt(int64_t i, int64_t seed) {
  return static_cast<float>(std::sin(0.377 * static_cast<double>(i) + seed));
}

// Every row count; matrices whose width is and is not a multiple of the 64-column panel, packed
// from a row stride wider than the matrix (a column block of a fused Q|K|V); views of all the
// columns and of column ranges that start and end inside a panel (the Q and the K|V of a fused
// Q|K|V whose width is not a multiple of 64), with and without a bias: y equals x W + b computed
// in double, within f32 rounding, and nothing past y's columns is written. Every flavour this CPU
// runs (each its own strips of a panel).
TEST(SmallMatmulTest, MatchesTheDefinitionForEveryFlavourRowCountWidthAndView) {
  constexpr int64_t kK = 37;
  const std::vector<std::string> flavours = SmallMatmulFlavours();
  ASSERT_FALSE(flavours.empty());
  EXPECT_EQ(flavours.back(), "portable");
  for (const std::string& flavour : flavours) {
    for (const int64_t n : {int64_t{8}, int64_t{64}, int64_t{100}, int64_t{192}, int64_t{300}}) {
      const int64_t ld = n + 24;
      std::vector<float> w(kK * ld);
      for (size_t i = 0; i < w.size(); ++i) w[i] = ValueAt(static_cast<int64_t>(i), 2);
      const SmallMatmulWeights packed(kK, n, w.data(), ld);
      ASSERT_EQ(packed.k(), kK);
      ASSERT_EQ(packed.n(), n);
      const std::vector<std::pair<int64_t, int64_t>> views = {
          {0, n}, {0, n / 3}, {n / 3, n - n / 3}, {n / 2, 1}, {n - 1, 1}};
      for (const auto& [first, cols] : views) {
        for (int64_t rows = 1; rows <= kSmallMatmulRows; ++rows) {
          for (const bool with_bias : {false, true}) {
            std::vector<float> x(rows * kK), bias(cols);
            std::vector<float> y(rows * cols + 16, -7.0f);
            for (size_t i = 0; i < x.size(); ++i) x[i] = ValueAt(static_cast<int64_t>(i), 1);
            for (int64_t c = 0; c < cols; ++c) bias[c] = ValueAt(c, 3);
            SmallMatmulWith(flavour, rows, packed, first, cols, x.data(),
                            with_bias ? bias.data() : nullptr, y.data());
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t c = 0; c < cols; ++c) {
                double want = with_bias ? bias[c] : 0.0;
                for (int64_t i = 0; i < kK; ++i) {
                  want += static_cast<double>(x[r * kK + i]) * w[i * ld + first + c];
                }
                ASSERT_NEAR(y[r * cols + c], want, 1e-5)
                    << flavour << " n " << n << " view " << first << "+" << cols << " rows " << rows
                    << " bias " << with_bias << " at " << r << "," << c;
              }
            }
            for (int64_t i = rows * cols; i < static_cast<int64_t>(y.size()); ++i) {
              ASSERT_EQ(y[i], -7.0f) << flavour << " wrote past y at " << i;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnserve::core
