#include "core/kv_block_pool.h"

#include <sys/mman.h>

#include <cstdint>

// AddressSanitizer cannot see inside the region: freed blocks are poisoned by hand, so that a
// step reading past its sequence's blocks into a free one is still reported.
#if defined(__SANITIZE_ADDRESS__)
#define ATTNSERVE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNSERVE_ASAN 1
#endif
#endif
#ifdef ATTNSERVE_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace attnserve::core {

namespace {

// Slabs beyond the budget's own: a size's partly used last slab, for a few sizes at once.
constexpr int64_t kSpareSlabs = 8;

}  // namespace

KvBlockPool::KvBlockPool(int64_t capacity_bytes) {
  if (capacity_bytes < 0) capacity_bytes = 0;
  const int64_t slabs = capacity_bytes / kKvSlabBytes + 1 + kSpareSlabs;
  // Address space only (PROT_NONE commits nothing), one slab more to align the base; slabs
  // become readable and writable as the high-water mark passes them.
  const int64_t bytes = (slabs + 1) * kKvSlabBytes;
  void* mapping = mmap(nullptr, static_cast<size_t>(bytes), PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping == MAP_FAILED) return;
  mapping_ = mapping;
  mapping_bytes_ = bytes;
  const auto address = reinterpret_cast<uintptr_t>(mapping);
  base_ =
      reinterpret_cast<unsigned char*>((address + kKvSlabBytes - 1) / kKvSlabBytes * kKvSlabBytes);
  slabs_total_ = slabs;
}

KvBlockPool::~KvBlockPool() {
  if (mapping_ == nullptr) return;
  UNPOISON(base_, static_cast<int64_t>(slabs_.size()) * kKvSlabBytes);
  munmap(mapping_, static_cast<size_t>(mapping_bytes_));
}

int64_t KvBlockPool::slab_bytes() const {
  std::lock_guard lock(mu_);
  return taken_ * kKvSlabBytes;
}

int64_t KvBlockPool::TakeSlabs(int64_t span) {
  const auto high = static_cast<int64_t>(slabs_.size());
  int64_t first = -1;
  // The lowest free run below the high-water mark, else the mark moves up.
  if (free_below_high_ >= span) {
    for (int64_t i = 0, run = 0; i < high; ++i) {
      run = slabs_[i].taken ? 0 : run + 1;
      if (run == span) {
        first = i - span + 1;
        break;
      }
    }
  }
  if (first >= 0) {
    free_below_high_ -= span;
  } else {
    if (span > slabs_total_ - high) return -1;
    if (mprotect(SlabAddress(high), static_cast<size_t>(span * kKvSlabBytes),
                 PROT_READ | PROT_WRITE) != 0) {
      return -1;
    }
    slabs_.resize(static_cast<size_t>(high + span));
    first = high;
  }
  for (int64_t i = first; i < first + span; ++i) slabs_[i].taken = true;
  taken_ += span;
  return first;
}

void KvBlockPool::ReturnSlabs(int64_t first) {
  const int64_t span = slabs_[first].span;
  // Its pages go back to the system now (they read as zeros when taken again).
  madvise(SlabAddress(first), static_cast<size_t>(span * kKvSlabBytes), MADV_DONTNEED);
  for (int64_t i = first; i < first + span; ++i) slabs_[i] = Slab{};
  free_below_high_ += span;
  taken_ -= span;
}

unsigned char* KvBlockPool::Allocate(int64_t bytes) {
  if (base_ == nullptr || bytes <= 0 || bytes % 64 != 0) return nullptr;
  std::lock_guard lock(mu_);
  std::set<int64_t>& room = room_[bytes];
  if (room.empty()) {
    const int64_t span = (bytes + kKvSlabBytes - 1) / kKvSlabBytes;
    const int64_t first = TakeSlabs(span);
    if (first < 0) return nullptr;
    Slab& slab = slabs_[first];
    slab.span = span;
    const int64_t blocks = span == 1 ? kKvSlabBytes / bytes : 1;
    slab.free.resize(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) slab.free[b] = static_cast<int32_t>(blocks - 1 - b);
    POISON(SlabAddress(first), span * kKvSlabBytes);
    room.insert(first);
  }
  const int64_t first = *room.begin();
  Slab& slab = slabs_[first];
  const int32_t index = slab.free.back();
  slab.free.pop_back();
  ++slab.live;
  if (slab.free.empty()) room.erase(room.begin());
  unsigned char* block = SlabAddress(first) + index * bytes;
  UNPOISON(block, bytes);
  return block;
}

void KvBlockPool::Free(unsigned char* block, int64_t bytes) {
  if (block == nullptr) return;
  std::lock_guard lock(mu_);
  const int64_t offset = block - base_;
  const int64_t first = offset / kKvSlabBytes;
  Slab& slab = slabs_[first];
  slab.free.push_back(static_cast<int32_t>((offset - first * kKvSlabBytes) / bytes));
  --slab.live;
  POISON(block, bytes);
  std::set<int64_t>& room = room_[bytes];
  room.insert(first);
  // An empty slab goes back unless it is its size's only room: a sequence that steps back and
  // forth over a block's edge does not take and return a slab each time.
  if (slab.live == 0 && room.size() > 1) {
    room.erase(first);
    ReturnSlabs(first);
  }
}

}  // namespace attnserve::core
