#pragma once

// Where the blocks of every KV cache under one budget live (the server has one budget, so one
// pool): one region of address space, reserved once and touched only as blocks are handed out,
// carved into slabs of kKvSlabBytes that each hold blocks of one size (one per model width and
// cache precision). Freed blocks go back to their slab for any thread's next block, and a slab
// left empty goes back to the system (at once, or once it has stayed empty a while: see
// KeepIdleSlabs), so the memory the caches hold resident follows what sessions hold, within
// the budget, whichever thread allocated or freed them. (Blocks from malloc stayed resident in
// its arenas after every session had ended: the process kept its peak.)

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

namespace attnserve::core {

// A slab: the unit the region is handed out and returned in (a huge page's size).
inline constexpr int64_t kKvSlabBytes = int64_t{2} << 20;

class KvBlockPool {
 public:
  // Reserves address space for `capacity_bytes` of blocks: twice that (no block size leaves
  // more than half a slab's bytes unused, so blocks of one size fill the capacity whatever
  // their size) and a few slabs more, no memory until blocks are handed out. When the space
  // cannot be reserved, reserved() is false and every Allocate returns null.
  explicit KvBlockPool(int64_t capacity_bytes);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  bool reserved() const { return base_ != nullptr; }

  // Why Allocate gave no block.
  enum class Refusal {
    kRegionHeld,  // every slab is held by blocks of other sizes (or too scattered for a span)
    kNoMemory,    // the system refused memory (or the pool has no region)
  };

  // A block of `bytes` (> 0, a multiple of 64), starting on a cache line; null when no slab can
  // take it, and then `*why` (when given) says why. Thread safe; never throws.
  unsigned char* Allocate(int64_t bytes, Refusal* why = nullptr) noexcept;
  // Returns a block Allocate(bytes) gave. Thread safe; never allocates.
  void Free(unsigned char* block, int64_t bytes) noexcept;
  // Makes the pages of a block Allocate gave present and writable, in one call (Allocate does,
  // outside its lock): a new block's pages then cost the thread that reserves it, rather than
  // a fault at each page's first write in the step that fills it, on the compute thread, for
  // every session in the run. (64 sequences 768 wide take a new block every 16 steps: 1536
  // faults, and the step took 4x as long in a VM whose first touch of a page faults in its host
  // too.) The edges of its neighbours' pages, in the same slab, come too. False when the kernel
  // cannot (before Linux 5.14): the pages then come as faults.
  static bool Prefault(unsigned char* block, int64_t bytes) noexcept;

  // On: an emptied slab stays resident, idle, until ReleaseIdleSlabs finds it idle a second
  // time (whoever keeps them calls it every period), and a new slab is an idle one when one is.
  // Off (the default): an empty slab goes back to the system at once, and turning it off gives
  // back the idle ones. Sessions that end and start take the same pages again instead of
  // faulting new ones in (in a VM whose first touch of a page took 13 us, 64 sequences of a
  // 768-wide f32 layer took 7-8% less server CPU a token on reused pages), as jemalloc keeps
  // freed pages a while (its decay) for the same reason. A block, from a slab idle or not, holds
  // whatever was last written there.
  void KeepIdleSlabs(bool keep);
  // Gives back to the system the idle slabs that were already idle at the last call; their
  // bytes. Called every period (the server's --heap-trim-secs), an emptied slab goes back after
  // one to two periods unused.
  int64_t ReleaseIdleSlabs();

  // Bytes of the slabs held for blocks now, and of the idle ones: what the caches hold resident
  // at most.
  int64_t slab_bytes() const;
  // Calls `observer` with slab_bytes() now and whenever it changes (under the pool's lock: it
  // must not call the pool), e.g. to set a gauge.
  void ObserveSlabBytes(std::function<void(int64_t)> observer);
  // Bytes the region spans (its slabs, all told).
  int64_t region_bytes() const { return slabs_total_ * kKvSlabBytes; }

 private:
  struct Slab {
    bool taken = false;  // held for blocks (as the first slab of its span or a later one)
    // Not taken, and kept resident (KeepIdleSlabs); `seen` once ReleaseIdleSlabs has found
    // it so, and it goes back at the next.
    bool idle = false;
    bool seen = false;
    int64_t span = 1;  // the first slab of a span: slabs it takes (> 1 for a block larger
                       // than a slab)
    int64_t live = 0;  // blocks handed out
    // Its free blocks, the next one handed out last. Its capacity holds every block of the
    // slab, so that Free never allocates.
    std::vector<int32_t> free{};
  };
  // The slabs of one block size with a free block: a bit per slab of the region, so that the
  // lowest is found first (new blocks fill the lowest slabs, so that the highest empty first)
  // and a Free allocates nothing.
  struct Room {
    std::vector<uint64_t> bits;
    int64_t lowest_word = 0;  // no bit is set below it
    int64_t count = 0;        // bits set
    // An empty slab kept as the size's only room (-1: none): a sequence that steps back and
    // forth over a block's edge does not take and return a slab each time. It goes back once
    // another slab has room, or another size finds the region held.
    int64_t kept = -1;
  };

  unsigned char* AllocateLocked(int64_t bytes, Refusal* why);
  // The first of `span` adjacent free slabs, now taken; -1 when the region has none, -2 when
  // the system refused their memory.
  int64_t TakeSlabs(int64_t span);
  void ReturnSlabs(int64_t first);
  // Returns the slab `room` keeps, if any.
  void ReturnKept(Room& room);
  // Returns the empty slab each block size keeps (a size that needs a slab keeps none);
  // whether it did any.
  bool ReturnKeptSlabs();
  int64_t SlabBytesLocked() const;
  void SlabBytesChanged();  // tells the observer
  static void SetRoom(Room& room, int64_t slab);
  static void ClearRoom(Room& room, int64_t slab);
  static int64_t LowestRoom(Room& room);
  unsigned char* SlabAddress(int64_t index) const { return base_ + index * kKvSlabBytes; }

  unsigned char* base_ = nullptr;  // kKvSlabBytes-aligned
  void* mapping_ = nullptr;        // what mmap gave (base_ is aligned within it)
  int64_t mapping_bytes_ = 0;
  int64_t slabs_total_ = 0;

  mutable std::mutex mu_;
  std::vector<Slab> slabs_;      // those below the high-water mark, the only ones ever touched
  int64_t free_below_high_ = 0;  // free slabs among them (the rest are held for blocks)
  bool keep_idle_ = false;
  int64_t idle_slabs_ = 0;  // free slabs among them kept resident (idle)
  std::function<void(int64_t)> observer_;
  std::map<int64_t, Room> room_;  // by block size
};

}  // namespace attnserve::core
