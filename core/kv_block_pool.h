#pragma once

// Where every KV cache block of the process lives: one region of address space, reserved once
// for the whole budget and touched only as blocks are handed out, carved into slabs of
// kKvSlabBytes that each hold blocks of one size (one per model width and cache precision).
// Freed blocks go back to their slab for any thread's next block, and a slab left empty goes
// back to the system, so the memory the caches hold follows what sessions hold, bounded by the
// region, whichever thread allocated or freed them. (Blocks from malloc stayed resident in its
// arenas after every session had ended: the process kept its peak.)

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace attnserve::core {

// A slab: the unit the region is handed out and returned in (a huge page's size).
inline constexpr int64_t kKvSlabBytes = int64_t{2} << 20;

class KvBlockPool {
 public:
  // Reserves address space for `capacity_bytes` of blocks (rounded up to slabs, plus a few
  // slabs for partly used ones): no memory until blocks are handed out. When the space cannot
  // be reserved, reserved() is false and every Allocate returns null.
  explicit KvBlockPool(int64_t capacity_bytes);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  bool reserved() const { return base_ != nullptr; }

  // A block of `bytes` (> 0, a multiple of 64), starting on a cache line; null when no slab is
  // free for it (the region is held by blocks of other sizes, or is spent). Thread safe.
  unsigned char* Allocate(int64_t bytes);
  // Returns a block Allocate(bytes) gave. Thread safe.
  void Free(unsigned char* block, int64_t bytes);

  // Bytes of the slabs held for blocks now: what the caches can hold resident at most.
  int64_t slab_bytes() const;
  // Bytes the region spans (its slabs, all told).
  int64_t region_bytes() const { return slabs_total_ * kKvSlabBytes; }

 private:
  struct Slab {
    bool taken = false;         // held for blocks (as the first slab of its span or a later one)
    int64_t span = 1;           // the first slab of a span: slabs it takes (> 1 for a block larger
                                // than a slab)
    int64_t live = 0;           // blocks handed out
    std::vector<int32_t> free;  // its free blocks, the lowest last
  };

  // The first of `span` adjacent free slabs, now taken, or -1.
  int64_t TakeSlabs(int64_t span);
  void ReturnSlabs(int64_t first);
  unsigned char* SlabAddress(int64_t index) const { return base_ + index * kKvSlabBytes; }

  unsigned char* base_ = nullptr;  // kKvSlabBytes-aligned
  void* mapping_ = nullptr;        // what mmap gave (base_ is aligned within it)
  int64_t mapping_bytes_ = 0;
  int64_t slabs_total_ = 0;

  mutable std::mutex mu_;
  std::vector<Slab> slabs_;      // those below the high-water mark, the only ones ever touched
  int64_t free_below_high_ = 0;  // free slabs among them
  int64_t taken_ = 0;            // slabs held for blocks
  // Per block size, the slabs with a free block, lowest address first (new blocks fill the
  // lowest slabs, so that the highest empty first).
  std::map<int64_t, std::set<int64_t>> room_;
};

}  // namespace attnserve::core
