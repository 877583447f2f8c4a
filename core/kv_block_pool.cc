#include "core/kv_block_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <new>

// AddressSanitizer cannot see inside the region: blocks are poisoned by hand while free, and
// each is followed by a poisoned gap (as malloc's redzones), so that a step reading past its
// own blocks, into a free one or a neighbour's, is still reported.
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

#ifndef MADV_POPULATE_WRITE  // (Linux 5.14; older C library headers lack the name)
#define MADV_POPULATE_WRITE 23
#endif

namespace attnserve::core {

namespace {

#ifdef ATTNSERVE_ASAN
constexpr int64_t kRedzone = 64;
#else
constexpr int64_t kRedzone = 0;
#endif

// Slabs beyond twice the capacity: a partly used last slab for each of a few sizes at once.
constexpr int64_t kSpareSlabs = 8;

// Bytes from one block's start to the next's.
int64_t Stride(int64_t bytes) { return bytes + kRedzone; }
// Slabs one slab of `bytes` blocks takes, and the blocks it holds.
int64_t SpanOf(int64_t bytes) { return (Stride(bytes) + kKvSlabBytes - 1) / kKvSlabBytes; }
int64_t BlocksPerSlab(int64_t bytes) {
  return SpanOf(bytes) == 1 ? kKvSlabBytes / Stride(bytes) : 1;
}

}  // namespace

KvBlockPool::KvBlockPool(int64_t capacity_bytes) {
  if (capacity_bytes < 0) capacity_bytes = 0;
  // (A capacity so large that twice it overflows cannot be reserved anyway.)
  if (capacity_bytes > (int64_t{1} << 61)) return;
  const int64_t slabs = 2 * (capacity_bytes / kKvSlabBytes + 1) + kSpareSlabs;
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
  return SlabBytesLocked();
}

int64_t KvBlockPool::SlabBytesLocked() const {
  return (static_cast<int64_t>(slabs_.size()) - free_below_high_ + idle_slabs_) * kKvSlabBytes;
}

void KvBlockPool::ObserveSlabBytes(std::function<void(int64_t)> observer) {
  std::lock_guard lock(mu_);
  observer_ = std::move(observer);
  SlabBytesChanged();
}

void KvBlockPool::SlabBytesChanged() {
  if (observer_) observer_(SlabBytesLocked());
}

void KvBlockPool::KeepIdleSlabs(bool keep) {
  {
    std::lock_guard lock(mu_);
    keep_idle_ = keep;
  }
  if (!keep) {  // all go back: each idle one is seen by the first call, returned by the second
    ReleaseIdleSlabs();
    ReleaseIdleSlabs();
  }
}

int64_t KvBlockPool::ReleaseIdleSlabs() {
  int64_t released = 0;
  // One slab given back a hold of the lock (its pages go back under it, so that no Allocate
  // takes it meanwhile), so that giving back thousands does not stall every step. (Marking
  // those idle for the first time walks the slabs in the same hold: 3 000 for a 6 GiB budget,
  // every period.)
  for (int64_t next = 0;;) {
    std::lock_guard lock(mu_);
    if (idle_slabs_ == 0) break;
    const auto high = static_cast<int64_t>(slabs_.size());
    while (next < high && !(slabs_[next].idle && slabs_[next].seen)) {
      if (slabs_[next].idle) slabs_[next].seen = true;
      ++next;
    }
    if (next == high) break;
    madvise(SlabAddress(next), static_cast<size_t>(kKvSlabBytes), MADV_DONTNEED);
    slabs_[next].idle = slabs_[next].seen = false;
    --idle_slabs_;
    SlabBytesChanged();
    released += kKvSlabBytes;
    ++next;
  }
  return released;
}

void KvBlockPool::SetRoom(Room& room, int64_t slab) {
  uint64_t& word = room.bits[slab / 64];
  const uint64_t bit = uint64_t{1} << (slab % 64);
  if (word & bit) return;
  word |= bit;
  ++room.count;
  room.lowest_word = std::min(room.lowest_word, slab / 64);
}

void KvBlockPool::ClearRoom(Room& room, int64_t slab) {
  uint64_t& word = room.bits[slab / 64];
  const uint64_t bit = uint64_t{1} << (slab % 64);
  if (!(word & bit)) return;
  word &= ~bit;
  --room.count;
}

int64_t KvBlockPool::LowestRoom(Room& room) {
  if (room.count == 0) return -1;
  const auto words = static_cast<int64_t>(room.bits.size());
  while (room.lowest_word < words && room.bits[room.lowest_word] == 0) ++room.lowest_word;
  return room.lowest_word * 64 + std::countr_zero(room.bits[room.lowest_word]);
}

int64_t KvBlockPool::TakeSlabs(int64_t span) {
  const auto high = static_cast<int64_t>(slabs_.size());
  // The first of the lowest run of `span` free slabs below the high-water mark (idle ones only,
  // when asked); -1: none.
  const auto lowest_run = [&](bool idle_only) -> int64_t {
    for (int64_t i = 0, run = 0; i < high; ++i) {
      run = slabs_[i].taken || (idle_only && !slabs_[i].idle) ? 0 : run + 1;
      if (run == span) return i - span + 1;
    }
    return -1;
  };
  // The lowest idle run (its pages are there), else the lowest free run, else the mark moves
  // up.
  int64_t first = idle_slabs_ >= span ? lowest_run(true) : -1;
  if (first < 0 && free_below_high_ >= span) first = lowest_run(false);
  if (first >= 0) {
    free_below_high_ -= span;
  } else {
    if (span > slabs_total_ - high) return -1;
    slabs_.resize(static_cast<size_t>(high + span));  // (may throw: nothing else changed yet)
    if (mprotect(SlabAddress(high), static_cast<size_t>(span * kKvSlabBytes),
                 PROT_READ | PROT_WRITE) != 0) {
      slabs_.resize(static_cast<size_t>(high));
      return -2;
    }
    first = high;
  }
  // (An idle slab holds what its blocks last held: no reader looks past what a sequence wrote,
  // as in a block reused within its slab.)
  for (int64_t i = first; i < first + span; ++i) {
    if (slabs_[i].idle) --idle_slabs_;
    slabs_[i] = Slab{.taken = true};
  }
  SlabBytesChanged();
  return first;
}

void KvBlockPool::ReturnSlabs(int64_t first) {
  const int64_t span = slabs_[first].span;
  // Its pages stay, idle, or go back to the system now.
  if (!keep_idle_) {
    madvise(SlabAddress(first), static_cast<size_t>(span * kKvSlabBytes), MADV_DONTNEED);
  }
  for (int64_t i = first; i < first + span; ++i) slabs_[i] = Slab{.idle = keep_idle_};
  if (keep_idle_) idle_slabs_ += span;
  free_below_high_ += span;
  SlabBytesChanged();
}

void KvBlockPool::ReturnKept(Room& room) {
  if (room.kept < 0) return;
  ClearRoom(room, room.kept);
  ReturnSlabs(room.kept);
  room.kept = -1;
}

bool KvBlockPool::ReturnKeptSlabs() {
  bool returned = false;
  for (auto& [bytes, room] : room_) {
    if (room.kept < 0) continue;
    ReturnKept(room);
    returned = true;
  }
  return returned;
}

unsigned char* KvBlockPool::Allocate(int64_t bytes, Refusal* why) noexcept {
  Refusal ignored;
  if (why == nullptr) why = &ignored;
  *why = Refusal::kNoMemory;
  if (base_ == nullptr || bytes <= 0 || bytes % 64 != 0) return nullptr;
  if (SpanOf(bytes) > slabs_total_) {
    *why = Refusal::kRegionHeld;
    return nullptr;
  }
  unsigned char* block;
  {
    std::lock_guard lock(mu_);
    try {
      block = AllocateLocked(bytes, why);
    } catch (const std::bad_alloc&) {  // the bookkeeping's (state stays whole: see there)
      *why = Refusal::kNoMemory;
      return nullptr;
    }
  }
  if (block != nullptr) Prefault(block, bytes);
  return block;
}

bool KvBlockPool::Prefault(unsigned char* block, int64_t bytes) noexcept {
  static const auto kPage = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(block) / kPage * kPage;
  const auto end =
      (reinterpret_cast<uintptr_t>(block) + static_cast<uintptr_t>(bytes) + kPage - 1) / kPage *
      kPage;
  return madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE) == 0;
}

unsigned char* KvBlockPool::AllocateLocked(int64_t bytes, Refusal* why) {
  // Whatever allocates comes before anything changes, but for a retry's TakeSlabs after
  // ReturnKeptSlabs (which leaves a whole state: slabs returned).
  auto it = room_.find(bytes);
  if (it == room_.end()) {
    Room first_of_its_size{.bits = std::vector<uint64_t>((slabs_total_ + 63) / 64)};
    it = room_.emplace(bytes, std::move(first_of_its_size)).first;
  }
  Room& room = it->second;
  if (room.count == 0) {
    const int64_t span = SpanOf(bytes);
    const int64_t blocks = BlocksPerSlab(bytes);
    std::vector<int32_t> free(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) free[b] = static_cast<int32_t>(blocks - 1 - b);
    int64_t first = TakeSlabs(span);
    // The region is held: the empty slabs other sizes keep go back, and it looks again.
    if (first == -1 && ReturnKeptSlabs()) first = TakeSlabs(span);
    if (first < 0) {
      *why = first == -1 ? Refusal::kRegionHeld : Refusal::kNoMemory;
      return nullptr;
    }
    Slab& slab = slabs_[first];
    slab.span = span;
    slab.free = std::move(free);
    POISON(SlabAddress(first), span * kKvSlabBytes);
    SetRoom(room, first);
  }
  const int64_t first = LowestRoom(room);
  if (first == room.kept) room.kept = -1;
  Slab& slab = slabs_[first];
  const int32_t index = slab.free.back();
  slab.free.pop_back();
  ++slab.live;
  if (slab.free.empty()) ClearRoom(room, first);
  unsigned char* block = SlabAddress(first) + index * Stride(bytes);
  UNPOISON(block, bytes);
  return block;
}

void KvBlockPool::Free(unsigned char* block, int64_t bytes) noexcept {
  if (block == nullptr) return;
  std::lock_guard lock(mu_);
  const int64_t offset = block - base_;
  const int64_t first = offset / kKvSlabBytes;
  Slab& slab = slabs_[first];
  slab.free.push_back(static_cast<int32_t>((offset - first * kKvSlabBytes) / Stride(bytes)));
  --slab.live;
  POISON(block, bytes);
  Room& room = room_.find(bytes)->second;
  SetRoom(room, first);
  // An empty slab goes back, unless it is its size's only room (then kept); and a slab kept
  // goes back once another has room.
  if (slab.live == 0) {
    if (room.count > 1) {
      ClearRoom(room, first);
      ReturnSlabs(first);
    } else {
      room.kept = first;
    }
  }
  if (room.kept >= 0 && room.kept != first && room.count > 1) ReturnKept(room);
}

}  // namespace attnserve::core
