#pragma once

#include <chrono>

namespace attnserve::server {

// The one clock of queues, deadlines and run times: steady, never set back.
using Clock = std::chrono::steady_clock;

// Seconds from `start` to now.
inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace attnserve::server
