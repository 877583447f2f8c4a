#pragma once

#include <cstdint>

namespace attnserve::server {

// What a model's compute runs cost, learnt from the runs themselves: seconds ≈ fixed +
// per_token · tokens, fitted by least squares over recent runs (exponentially weighted, so a
// changed load or machine is followed within a few dozen runs). Admission and the scheduler
// ask it how long queued work and a call's own run will take, to refuse at once a call whose
// deadline cannot be met. Not thread safe: its scheduler guards it.
class RunCost {
 public:
  // One run of `tokens` tokens (input + context) took `seconds`.
  void Observe(int64_t tokens, double seconds);

  // Seconds `runs` runs holding `tokens` tokens in all are expected to take; 0 before any run
  // was seen (nothing is refused on a guess).
  double Estimate(int64_t tokens, int64_t runs = 1) const;

  bool known() const { return weight_ > 0; }

 private:
  // Weight of the newest run against the ones before (about the last 30 runs count).
  static constexpr double kDecay = 0.97;

  void Fit(double* fixed, double* slope) const;

  // Exponentially weighted sums of 1, x, y, x², xy (x tokens, y seconds).
  double weight_ = 0, sum_x_ = 0, sum_y_ = 0, sum_xx_ = 0, sum_xy_ = 0;
};

}  // namespace attnserve::server
