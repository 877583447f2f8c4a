#include "server/base/heap_trimmer.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>

namespace attnserve::server {

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  if (!(statm >> pages >> resident)) return 0;
  return resident * sysconf(_SC_PAGESIZE);
}

namespace {

// The bytes of free chunks in every arena, resident or not (a trim leaves them in place).
int64_t HeapFreeBytes() { return static_cast<int64_t>(mallinfo2().fordblks); }

}  // namespace

HeapTrimmer::HeapTrimmer(int64_t min_growth)
    : min_growth_(min_growth), resident_base_(ResidentBytes()), free_base_(HeapFreeBytes()) {}

std::optional<HeapTrimmer::Trim> HeapTrimmer::TrimIfGrown() {
  Trim trim;
  trim.resident_before = ResidentBytes();
  const int64_t free = HeapFreeBytes();
  resident_base_ = std::min(resident_base_, trim.resident_before);
  free_base_ = std::min(free_base_, free);
  if (trim.resident_before - resident_base_ < min_growth_ && free - free_base_ < min_growth_) {
    return std::nullopt;
  }
  const auto start = std::chrono::steady_clock::now();
  malloc_trim(0);
  trim.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  trim.resident_after = ResidentBytes();
  resident_base_ = trim.resident_after;
  free_base_ = HeapFreeBytes();
  return trim;
}

}  // namespace attnserve::server
