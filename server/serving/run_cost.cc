#include "server/serving/run_cost.h"

#include <algorithm>

namespace attnserve::server {

void RunCost::Observe(int64_t tokens, double seconds) {
  const double x = static_cast<double>(std::max<int64_t>(tokens, 1));
  weight_ = weight_ * kDecay + 1;
  sum_x_ = sum_x_ * kDecay + x;
  sum_y_ = sum_y_ * kDecay + seconds;
  sum_xx_ = sum_xx_ * kDecay + x * x;
  sum_xy_ = sum_xy_ * kDecay + x * seconds;
}

void RunCost::Fit(double* fixed, double* slope) const {
  const double mean_x = sum_x_ / weight_;
  const double mean_y = sum_y_ / weight_;
  const double var_x = sum_xx_ / weight_ - mean_x * mean_x;
  const double cov = sum_xy_ / weight_ - mean_x * mean_y;
  // Runs of (nearly) one size cannot tell the fixed part from the slope: all of it is per
  // token then. A negative fit (noise) is no better.
  if (var_x <= 1e-6 * mean_x * mean_x || cov <= 0) {
    *fixed = 0;
    *slope = mean_y / mean_x;
    return;
  }
  *slope = cov / var_x;
  *fixed = mean_y - *slope * mean_x;
  if (*fixed < 0) {
    *fixed = 0;
    *slope = mean_y / mean_x;
  }
}

double RunCost::Estimate(int64_t tokens, int64_t runs) const {
  if (!known()) return 0;
  double fixed = 0, slope = 0;
  Fit(&fixed, &slope);
  return fixed * static_cast<double>(std::max<int64_t>(runs, 1)) +
         slope * static_cast<double>(std::max<int64_t>(tokens, 0));
}

}  // namespace attnserve::server
