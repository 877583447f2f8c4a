#pragma once

// A loop over [0, n) on the calling thread's OpenMP team, or on the calling thread alone when a
// team is not worth it (too little work) or there is none (one thread: a serial call, a step run
// on a transport thread). Alone, no OpenMP region is entered at all: libgomp ends every region,
// even one of a single thread or one whose `if` clause is false, at a barrier that wakes its
// waiters with a futex system call, needed or not; a 1-token generation step paid one for its
// attention, beside a transport's few system calls a message.

#include <omp.h>

#include <cstdint>

namespace attnserve::core {

enum class LoopSchedule {
  kStatic,   // equal shares, one a thread
  kDynamic,  // one item at a time to whichever thread is free (items of unequal cost)
};

template <typename Body>
void ParallelFor(bool worth_a_team, int64_t n, const Body& body,
                 LoopSchedule schedule = LoopSchedule::kStatic) {
  if (!worth_a_team || n < 2 || omp_get_max_threads() == 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  if (schedule == LoopSchedule::kDynamic) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

}  // namespace attnserve::core
