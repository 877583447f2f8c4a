#pragma once

// Float comparisons of the test binaries: one assertion for a whole row or tensor, which names
// the worst entry when it fails. Header-only, as the only part of tests/common that uses gtest
// (attnserve_test_common stays free of it).

#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve::test {

// |actual - expected| <= tolerance at every one of `size` entries (NaN fails), else the worst
// entry, named with `what`.
inline ::testing::AssertionResult AllNear(const float* actual, const float* expected, int64_t size,
                                          double tolerance, std::string_view what = "values") {
  double worst = 0.0;
  int64_t worst_at = -1;
  for (int64_t i = 0; i < size; ++i) {
    double diff = std::fabs(static_cast<double>(actual[i]) - expected[i]);
    if (std::isnan(diff)) diff = INFINITY;
    if (worst_at < 0 || diff > worst) {
      worst = diff;
      worst_at = i;
    }
  }
  if (worst_at < 0 || worst <= tolerance) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": max |diff| " << worst << " at flat index " << worst_at << " (got "
         << actual[worst_at] << ", expected " << expected[worst_at] << ")";
}

// The same for two whole vectors, which must also have the same size.
inline ::testing::AssertionResult AllNear(const std::vector<float>& actual,
                                          const std::vector<float>& expected, double tolerance,
                                          std::string_view what = "values") {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << actual.size() << " values, expected " << expected.size();
  }
  return AllNear(actual.data(), expected.data(), static_cast<int64_t>(actual.size()), tolerance,
                 what);
}

}  // namespace attnserve::test
