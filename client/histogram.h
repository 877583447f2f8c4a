#pragma once

#include <cstdint>
#include <vector>

namespace attnserve::client {

// A log-linear (HDR-style) latency histogram: values in microseconds, each power of two split
// into 128 equal buckets, so any quantile is within 1/128 (< 0.8 %) of the true value whatever
// the range (a microsecond to hours) in a few kilobytes. Not thread-safe: one owner, or a lock.
class LatencyHistogram {
 public:
  // One non-empty bucket: values in [low_us, high_us).
  struct Bucket {
    int64_t low_us = 0;
    int64_t high_us = 0;
    int64_t count = 0;
  };

  // Counts one value; negative values count as 0.
  void Record(int64_t value_us);

  // Adds every value of `other`.
  void Merge(const LatencyHistogram& other);

  // The value at quantile q in [0, 1] (nearest rank), as its bucket's midpoint clipped to the
  // exact minimum and maximum; 0 when empty.
  int64_t ValueAtQuantile(double q) const;

  // Values recorded.
  int64_t count() const { return count_; }
  // The exact largest and smallest values (0 when empty).
  int64_t max() const { return max_; }
  int64_t min() const { return count_ > 0 ? min_ : 0; }
  // The exact mean (0 when empty).
  double mean() const;

  // The non-empty buckets, lowest first.
  std::vector<Bucket> Buckets() const;

 private:
  std::vector<int64_t> counts_;
  int64_t count_ = 0;
  int64_t max_ = 0;
  int64_t min_ = INT64_MAX;
  double sum_ = 0;
};

}  // namespace attnserve::client
