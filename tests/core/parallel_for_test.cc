#include "core/parallel_for.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace attnserve::core {
namespace {

// Every index runs once, whichever way the loop goes. Alone (too little work, or one thread) it
// enters no OpenMP region, not even an inactive one: libgomp ends every region with a futex
// system call, which a 1-token step paid for nothing. Only with a team worth starting does the
// body run inside a region.
TEST(ParallelForTest, RunsEveryIndexOnceAndEntersARegionOnlyForATeam) {
  const int saved = omp_get_max_threads();
  constexpr int64_t kCount = 100;
  for (const LoopSchedule schedule : {LoopSchedule::kStatic, LoopSchedule::kDynamic}) {
    for (const bool worth_a_team : {false, true}) {
      for (const int threads : {1, 2}) {
        omp_set_num_threads(threads);
        std::vector<std::atomic<int>> runs(kCount);
        std::atomic<int> in_a_region = 0;
        ParallelFor(
            worth_a_team, kCount,
            [&](int64_t i) {
              runs[i].fetch_add(1);
              if (omp_get_level() > 0) in_a_region.fetch_add(1);
            },
            schedule);
        SCOPED_TRACE(::testing::Message()
                     << "dynamic " << (schedule == LoopSchedule::kDynamic) << ", worth a team "
                     << worth_a_team << ", threads " << threads);
        for (int64_t i = 0; i < kCount; ++i) EXPECT_EQ(runs[i].load(), 1) << "index " << i;
        EXPECT_EQ(in_a_region.load(), worth_a_team && threads > 1 ? kCount : 0);
      }
    }
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace attnserve::core
