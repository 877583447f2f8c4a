#include "client/histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace attnserve::client {
namespace {

// 2^7 buckets per power of two: relative bucket width below 1/128.
constexpr int kSubBits = 7;
constexpr int64_t kSubCount = int64_t{1} << kSubBits;
// Values past ~35 years in microseconds are clipped: no call lasts that long.
constexpr int64_t kLargest = int64_t{1} << 60;

// Values below 128 get a bucket each; above, the top 8 significant bits pick the bucket.
size_t IndexOf(int64_t value) {
  if (value < kSubCount) return static_cast<size_t>(value);
  const int msb = 63 - std::countl_zero(static_cast<uint64_t>(value));
  const int shift = msb - kSubBits;
  const int64_t top = value >> shift;  // in [128, 256)
  return static_cast<size_t>((shift + 1) * kSubCount + (top - kSubCount));
}

// The inverse of IndexOf: the bucket's lowest value and its width.
void BoundsOf(size_t index, int64_t& low, int64_t& width) {
  const auto i = static_cast<int64_t>(index);
  if (i < 2 * kSubCount) {
    low = i;
    width = 1;
    return;
  }
  const int64_t shift = i / kSubCount - 1;
  low = (kSubCount + i % kSubCount) << shift;
  width = int64_t{1} << shift;
}

}  // namespace

void LatencyHistogram::Record(int64_t value_us) {
  const int64_t value = std::clamp<int64_t>(value_us, 0, kLargest);
  const size_t index = IndexOf(value);
  if (index >= counts_.size()) counts_.resize(index + 1, 0);
  ++counts_[index];
  ++count_;
  max_ = std::max(max_, value);
  min_ = std::min(min_, value);
  sum_ += static_cast<double>(value);
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  if (other.counts_.size() > counts_.size()) counts_.resize(other.counts_.size(), 0);
  for (size_t i = 0; i < other.counts_.size(); ++i) counts_[i] += other.counts_[i];
  count_ += other.count_;
  max_ = std::max(max_, other.max_);
  min_ = std::min(min_, other.min_);
  sum_ += other.sum_;
}

int64_t LatencyHistogram::ValueAtQuantile(double q) const {
  if (count_ == 0) return 0;
  const double clamped = std::clamp(q, 0.0, 1.0);
  const auto rank =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(clamped * static_cast<double>(count_))));
  int64_t seen = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    seen += counts_[i];
    if (seen >= rank) {
      int64_t low = 0, width = 0;
      BoundsOf(i, low, width);
      return std::clamp(low + width / 2, min(), max_);
    }
  }
  return max_;
}

double LatencyHistogram::mean() const {
  return count_ > 0 ? sum_ / static_cast<double>(count_) : 0.0;
}

std::vector<LatencyHistogram::Bucket> LatencyHistogram::Buckets() const {
  std::vector<Bucket> buckets;
  for (size_t i = 0; i < counts_.size(); ++i) {
    if (counts_[i] == 0) continue;
    int64_t low = 0, width = 0;
    BoundsOf(i, low, width);
    buckets.push_back({low, low + width, counts_[i]});
  }
  return buckets;
}

}  // namespace attnserve::client
