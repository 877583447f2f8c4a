#pragma once

#include <cstdint>
#include <functional>
#include <optional>

namespace attnserve::server {

// The process's resident memory (/proc/self/statm) in bytes; 0 when it cannot be read.
int64_t ResidentBytes();

// Gives the heap's free pages back to the system once resident memory (less what is not the
// heap's) or the heap's free bytes have grown since the last time it did. glibc's malloc keeps what
// a burst frees: a large message is read in many small pieces, spread over the arena of each gRPC
// thread, and the small allocations that outlive the burst pin them, so without this the server
// would stay at its peak for good (353 MB after a flood of 48 MiB messages, against 26 MB once
// trimmed). What the next burst needs comes back as page faults.
class HeapTrimmer {
 public:
  struct Trim {
    int64_t resident_before = 0;
    int64_t resident_after = 0;
    double seconds = 0;  // what malloc_trim took
  };

  static constexpr int64_t kMinGrowth = int64_t{16} << 20;

  // `min_growth`: the bytes resident memory or the heap's free bytes must have grown by since
  // the last trim (or since this was made) for a trim to be worth its arenas' locks and the
  // page faults after it. `not_heap`, when given: resident bytes that are not the heap's and
  // come and go with no trim to make (the KV cache's slabs), left out of resident memory.
  explicit HeapTrimmer(int64_t min_growth = kMinGrowth,
                       std::function<int64_t()> not_heap = nullptr);

  // Trims (malloc_trim) when, since the last trim (or since this was made), resident memory or
  // the heap's free bytes grew by min_growth from the lowest seen; what it did, or nothing.
  // Resident memory catches a burst between two looks. The free bytes catch a burst under way
  // at a trim: its messages, live then, are freed after it, and resident memory does not move.
  // Memory that does not go back (a model loaded, the KV cache's slabs) is trimmed for once,
  // then counted in.
  std::optional<Trim> TrimIfGrown();

 private:
  // Resident bytes that are not the heap's (not_heap_), now.
  int64_t NotHeap() const;

  const int64_t min_growth_;
  const std::function<int64_t()> not_heap_;
  int64_t resident_base_;
  int64_t free_base_;
};

}  // namespace attnserve::server
