#include "server/base/heap_trimmer.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <utility>

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

HeapTrimmer::HeapTrimmer(int64_t min_growth, std::function<int64_t()> not_heap)
    : min_growth_(min_growth),
      not_heap_(std::move(not_heap)),
      resident_base_(ResidentBytes() - NotHeap()),
      free_base_(HeapFreeBytes()) {}

int64_t HeapTrimmer::NotHeap() const { return not_heap_ ? not_heap_() : 0; }

std::optional<HeapTrimmer::Trim> HeapTrimmer::TrimIfGrown() {
  Trim trim;
  trim.resident_before = ResidentBytes();
  const int64_t not_heap = NotHeap();
  const int64_t heap = trim.resident_before - not_heap;
  const int64_t free = HeapFreeBytes();
  resident_base_ = std::min(resident_base_, heap);
  free_base_ = std::min(free_base_, free);
  if (heap - resident_base_ < min_growth_ && free - free_base_ < min_growth_) return std::nullopt;
  const auto start = std::chrono::steady_clock::now();
  malloc_trim(0);
  trim.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  trim.resident_after = ResidentBytes();
  resident_base_ = trim.resident_after - not_heap;
  free_base_ = HeapFreeBytes();
  return trim;
}

}  // namespace attnserve::server
