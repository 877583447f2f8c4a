#include "core/small_matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace attnserve::core {
namespace {

// Every row count, widths that are and are not multiples of the 64-column tile, a row stride
// wider than the matrix (a column block of a fused Q|K|V), with and without a bias: y equals
// x W + b computed in double, within f32 rounding.
TEST(SmallMatmulTest, MatchesTheDefinitionForEveryRowCountAndWidth) {
  auto value_at = [](int64_t i, int64_t seed) {
    return static_cast<float>(std::sin(0.377 * static_cast<double>(i) + seed));
  };
  for (int64_t rows = 1; rows <= kSmallMatmulRows; ++rows) {
    for (const int64_t n : {int64_t{8}, int64_t{64}, int64_t{100}, int64_t{192}}) {
      for (const bool with_bias : {false, true}) {
        constexpr int64_t kK = 37;
        const int64_t ld = n + 24;
        std::vector<float> x(rows * kK), w(kK * ld), bias(n), y(rows * n, -7.0f);
        for (size_t i = 0; i < x.size(); ++i) x[i] = value_at(static_cast<int64_t>(i), 1);
        for (size_t i = 0; i < w.size(); ++i) w[i] = value_at(static_cast<int64_t>(i), 2);
        for (int64_t c = 0; c < n; ++c) bias[c] = value_at(c, 3);
        SmallMatmul(rows, kK, n, x.data(), w.data(), ld, with_bias ? bias.data() : nullptr,
                    y.data());
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < n; ++c) {
            double want = with_bias ? bias[c] : 0.0;
            for (int64_t i = 0; i < kK; ++i) {
              want += static_cast<double>(x[r * kK + i]) * w[i * ld + c];
            }
            ASSERT_NEAR(y[r * n + c], want, 1e-5) << "rows " << rows << " n " << n << " bias "
                                                  << with_bias << " at " << r << "," << c;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace attnserve::core
