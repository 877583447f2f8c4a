// Memory a burst freed goes back to the system: HeapTrimmer on this process's heap, and the real
// attnserve binary after a burst of large messages, with --heap-trim-secs and without.

#include "server/base/heap_trimmer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/common/sanitizers.h"
#include "tests/server/test_util.h"

namespace attnserve::server::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int64_t kMiB = int64_t{1} << 20;

int64_t ResidentBytesOf(pid_t pid) {
  std::ifstream statm("/proc/" + std::to_string(pid) + "/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

TEST(HeapTrimmerTest, GivesBackWhatABurstFreedOnce) {
  if (test::kSanitized) GTEST_SKIP() << "a sanitizer's allocator is not glibc's heap";
  HeapTrimmer trimmer(16 * kMiB);
  EXPECT_FALSE(trimmer.TrimIfGrown().has_value()) << "nothing grew yet";

  // 128 MiB in pieces below malloc's mmap threshold; every other one is freed, and its
  // neighbours, still in use, keep it from merging back into the heap's top (as a message read
  // in pieces over gRPC's threads, among what the calls keep).
  constexpr int kPieces = 4096;
  constexpr size_t kPiece = 32 * 1024;
  std::vector<char*> pieces;
  for (int i = 0; i < kPieces; ++i) {
    pieces.push_back(static_cast<char*>(malloc(kPiece)));
    ASSERT_NE(pieces.back(), nullptr);
    memset(pieces.back(), i, kPiece);
  }
  const int64_t full = ResidentBytes();
  for (int i = 0; i < kPieces; i += 2) free(pieces[i]);
  const int64_t freed = ResidentBytes();
  // What the trimmer is for: free alone gives (almost) nothing back.
  ASSERT_GT(freed, full - 16 * kMiB) << "free gave the pieces back by itself";

  std::optional<HeapTrimmer::Trim> trim = trimmer.TrimIfGrown();
  ASSERT_TRUE(trim.has_value()) << "resident memory grew by 128 MiB and no trim came";
  // 64 MiB freed, in pieces of 8 pages with a chunk header in the first: 7/8 of it can go.
  EXPECT_LT(trim->resident_after, trim->resident_before - 40 * kMiB);
  EXPECT_LT(ResidentBytes(), freed - 40 * kMiB);
  // Nothing grew since: no trim (the freed bytes it left in place count as its base).
  EXPECT_FALSE(trimmer.TrimIfGrown().has_value());
  for (int i = 1; i < kPieces; i += 2) free(pieces[i]);
}

TEST(HeapTrimmerTest, ResidentMemoryThatIsNotTheHeapsDoesNotTrim) {
  if (test::kSanitized) GTEST_SKIP() << "a sanitizer's allocator is not glibc's heap";
  // 64 MiB outside the heap, as the KV cache's slabs: resident memory grows, the heap does not.
  constexpr int64_t kBytes = 64 * kMiB;
  int64_t not_heap = 0;
  HeapTrimmer counted(16 * kMiB);
  HeapTrimmer left_out(16 * kMiB, [&] { return not_heap; });
  void* slabs = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(slabs, MAP_FAILED);
  memset(slabs, 1, kBytes);
  not_heap = kBytes;
  EXPECT_FALSE(left_out.TrimIfGrown().has_value());
  // The same growth, counted as the heap's, trims (and gives back nothing).
  EXPECT_TRUE(counted.TrimIfGrown().has_value());
  munmap(slabs, kBytes);
}

struct Burst {
  int64_t idle = 0;     // resident bytes before it
  int64_t lowest = 0;   // the lowest resident bytes seen in the `wait` after it
  int64_t trimmed = 0;  // what the logged trims gave back, all told
};

// An attnserve process with --heap-trim-secs `trim_secs` under 32 calls of 16 MiB at once, each
// refused once read (a width the model does not have); then up to `wait` (or until it is back
// within 32 MiB of idle) of its resident memory and its log.
Burst AfterABurst(const std::string& name, const std::string& trim_secs, milliseconds wait) {
  Burst burst;
  const std::string port_file = TempPath(name + ".port");
  ChildServer child({"--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen", "off",
                     "--http-listen", "off", "--heap-trim-secs", trim_secs, "--log-level", "debug",
                     "--log-format", "json"},
                    TempPath(name + ".log"));
  const int port = child.WaitForPort(port_file, seconds(20));
  EXPECT_GT(port, 0) << child.Output();
  if (port == 0) return burst;
  burst.idle = ResidentBytesOf(child.pid());

  constexpr int kCalls = 32;
  constexpr int64_t kRows = 16 * kMiB / (128 * sizeof(float));
  v1::ForwardRequest request;
  *request.mutable_input() = MakeTensor({kRows, 128}, std::vector<float>(kRows * 128, 0.25f), true);
  for (grpc::StatusCode code : FireTogether(port, kCalls, request, seconds(60))) {
    EXPECT_EQ(code, grpc::StatusCode::INVALID_ARGUMENT);
  }

  burst.lowest = ResidentBytesOf(child.pid());
  const auto until = std::chrono::steady_clock::now() + wait;
  while (std::chrono::steady_clock::now() < until && burst.lowest > burst.idle + 32 * kMiB) {
    std::this_thread::sleep_for(milliseconds(100));
    burst.lowest = std::min(burst.lowest, ResidentBytesOf(child.pid()));
  }
  // A trim's line comes after its malloc_trim and its look at /proc: its last trims' lines too.
  if (trim_secs != "0") {
    EXPECT_TRUE(child.WaitForOutput("heap trimmed", seconds(5))) << child.Output();
    std::this_thread::sleep_for(milliseconds(500));
  }
  std::istringstream lines(child.Output());
  std::string line;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || j.value("msg", "") != "heap trimmed") continue;
    burst.trimmed += std::max<int64_t>(
        (j.value("resident_mib_before", int64_t{0}) - j.value("resident_mib_after", int64_t{0})) *
            kMiB,
        0);
  }
  return burst;
}

TEST(HeapTrimmerTest, TheServerGivesBackWhatABurstOfLargeMessagesFreed) {
  if (test::kSanitized) GTEST_SKIP() << "a sanitizer's allocator is not glibc's heap";
  // Without the trimmer the burst's memory stays: what the flag changes.
  const Burst kept = AfterABurst("no-trim", "0", seconds(2));
  EXPECT_GT(kept.lowest, kept.idle + 64 * kMiB) << "idle " << kept.idle / kMiB << " MiB";
  EXPECT_EQ(kept.trimmed, 0);

  // With it, the heap's free pages go back; what glibc keeps of each arena's top (up to its
  // trim threshold, raised by the burst's largest blocks) may stay.
  const Burst trimmed = AfterABurst("trim", "0.2", seconds(10));
  // (In one trim or several: a trim while the calls are still arriving gives back part.)
  EXPECT_GE(trimmed.trimmed, 64 * kMiB) << "the trims did not give back the burst's memory";
  EXPECT_LT(trimmed.lowest, trimmed.idle + 128 * kMiB)
      << "idle " << trimmed.idle / kMiB << " MiB, after the burst " << trimmed.lowest / kMiB
      << " MiB";
}

}  // namespace
}  // namespace attnserve::server::testing
