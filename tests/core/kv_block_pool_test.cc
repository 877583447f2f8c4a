// The pool the KV caches' blocks come from: blocks fill slabs and are reused wherever they were
// freed, empty slabs go back to the system, and what the caches hold resident stays within the
// budget however sessions come and go.

#include "core/kv_block_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/kv_cache.h"
#include "gtest/gtest.h"

namespace attnserve::core {
namespace {

const int64_t kPage = sysconf(_SC_PAGESIZE);

// Pages of [p, p + bytes) resident now (p page-aligned).
int64_t ResidentPages(const unsigned char* p, int64_t bytes) {
  std::vector<unsigned char> pages(static_cast<size_t>((bytes + kPage - 1) / kPage));
  if (mincore(const_cast<unsigned char*>(p), static_cast<size_t>(bytes), pages.data()) != 0) {
    ADD_FAILURE() << "mincore: " << std::strerror(errno);
    return -1;
  }
  int64_t resident = 0;
  for (unsigned char page : pages) resident += page & 1;
  return resident;
}

// Whether transparent huge pages are on for every mapping ("[always]"), not only those asking.
bool HugePagesAlways() {
  std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string setting((std::istreambuf_iterator<char>(enabled)), std::istreambuf_iterator<char>());
  return setting.find("[always]") != std::string::npos;
}

// 96 KiB: a block of a 768-wide f32 layer (2 * 16 tokens * 768 * 4 bytes).
constexpr int64_t kBlock = 2 * kKvBlockTokens * 768 * 4;
constexpr int64_t kPerSlab = kKvSlabBytes / kBlock;  // 21

// `n` blocks of kBlock from `pool`, each written whole; fewer when the pool refused one.
std::vector<unsigned char*> WrittenBlocks(KvBlockPool& pool, int64_t n) {
  std::vector<unsigned char*> blocks;
  for (int64_t i = 0; i < n; ++i) {
    unsigned char* block = pool.Allocate(kBlock);
    if (block == nullptr) break;
    std::memset(block, 1, kBlock);
    blocks.push_back(block);
  }
  return blocks;
}

TEST(KvBlockPoolTest, BlocksFillOneSlabAtATimeAndFreedOnesAreReusedFirst) {
  KvBlockPool pool(64 << 20);
  ASSERT_TRUE(pool.reserved());
  std::vector<unsigned char*> blocks;
  std::set<const unsigned char*> slabs;
  for (int64_t i = 0; i < 2 * kPerSlab + 1; ++i) {
    unsigned char* block = pool.Allocate(kBlock);
    ASSERT_NE(block, nullptr) << i;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(block) % 64, 0u);
    std::memset(block, static_cast<int>(i), kBlock);  // writable, whole
    slabs.insert(reinterpret_cast<const unsigned char*>(reinterpret_cast<uintptr_t>(block) /
                                                        kKvSlabBytes * kKvSlabBytes));
    blocks.push_back(block);
  }
  EXPECT_EQ(slabs.size(), 3u);
  EXPECT_EQ(pool.slab_bytes(), 3 * kKvSlabBytes);
  // No two blocks overlap, and none was disturbed by another's writes.
  std::set<unsigned char*> distinct(blocks.begin(), blocks.end());
  EXPECT_EQ(distinct.size(), blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(blocks[i][0], static_cast<unsigned char>(i));
    EXPECT_EQ(blocks[i][kBlock - 1], static_cast<unsigned char>(i));
  }
  // A block freed in the first slab is the next one handed out, before the third slab's room.
  pool.Free(blocks[5], kBlock);
  EXPECT_EQ(pool.Allocate(kBlock), blocks[5]);
  for (unsigned char* block : blocks) pool.Free(block, kBlock);
}

// A new block's pages are present when Allocate returns it: the step that writes it does not
// fault them in one by one.
TEST(KvBlockPoolTest, ABlocksPagesArePresentBeforeItIsWritten) {
  void* probe = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(probe, MAP_FAILED);
  const bool populates = KvBlockPool::Prefault(static_cast<unsigned char*>(probe), kPage);
  munmap(probe, kPage);
  if (!populates) GTEST_SKIP() << "the kernel cannot populate pages (Linux 5.14 can)";
  KvBlockPool pool(64 << 20);
  unsigned char* block = pool.Allocate(kBlock);
  ASSERT_NE(block, nullptr);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(block) % kKvSlabBytes, 0u);
  // Its pages, not its slab's: no fault when the step writes it, no memory for blocks not given
  // (unless transparent huge pages are always on: the slab is then one page).
  EXPECT_EQ(ResidentPages(block, kBlock), kBlock / kPage);
  if (!HugePagesAlways()) {
    EXPECT_EQ(ResidentPages(block + kBlock, kKvSlabBytes - kBlock), 0);
  }
  unsigned char* next = pool.Allocate(kBlock);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(ResidentPages(block, 2 * kBlock), 2 * kBlock / kPage);
  pool.Free(next, kBlock);
  pool.Free(block, kBlock);
}

// An empty slab's pages go back to the system at once, except the last room of its size (a
// sequence stepping back and forth over a block's edge does not fault a slab in each time).
TEST(KvBlockPoolTest, AnEmptySlabGoesBackToTheSystemButItsSizesLastRoomStays) {
  KvBlockPool pool(64 << 20);
  std::vector<unsigned char*> blocks = WrittenBlocks(pool, 3 * kPerSlab);
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), 3 * kPerSlab);
  const unsigned char* first_slab = blocks.front();
  ASSERT_EQ(reinterpret_cast<uintptr_t>(first_slab) % kKvSlabBytes, 0u);
  EXPECT_GE(ResidentPages(first_slab, 3 * kKvSlabBytes), 3 * kPerSlab * kBlock / kPage);
  for (unsigned char* block : blocks) pool.Free(block, kBlock);
  EXPECT_EQ(pool.slab_bytes(), kKvSlabBytes);
  // The last slab to empty stayed, resident, as its size's room; the others went back (the one
  // kept as the first emptied went back once the next had room).
  const int64_t resident = ResidentPages(first_slab, 3 * kKvSlabBytes);
  EXPECT_LE(resident, kKvSlabBytes / kPage);
  EXPECT_GE(resident, kPerSlab * kBlock / kPage);
  unsigned char* next = pool.Allocate(kBlock);
  ASSERT_NE(next, nullptr);
  EXPECT_GE(next, blocks[2 * kPerSlab]);  // from the slab kept
  EXPECT_EQ(pool.slab_bytes(), kKvSlabBytes);
  pool.Free(next, kBlock);
}

// A slab kept empty as its size's only room goes back once another slab of the size has room:
// new blocks fill the lower one, and the kept one would sit empty, out of other sizes' reach.
TEST(KvBlockPoolTest, AKeptSlabGoesBackOnceAnotherHasRoom) {
  KvBlockPool pool(64 << 20);
  std::vector<unsigned char*> blocks;
  for (int64_t i = 0; i < 2 * kPerSlab; ++i) blocks.push_back(pool.Allocate(kBlock));
  for (int64_t i = kPerSlab; i < 2 * kPerSlab; ++i) pool.Free(blocks[i], kBlock);
  EXPECT_EQ(pool.slab_bytes(), 2 * kKvSlabBytes);  // the second slab kept, empty
  pool.Free(blocks[0], kBlock);
  EXPECT_EQ(pool.slab_bytes(), kKvSlabBytes);
  EXPECT_EQ(pool.Allocate(kBlock), blocks[0]);
  for (int64_t i = 0; i < kPerSlab; ++i) pool.Free(blocks[i], kBlock);
  EXPECT_EQ(pool.slab_bytes(), kKvSlabBytes);  // the first slab now kept
}

// Kept idle (as the server keeps them), emptied slabs stay resident until a second look finds
// them still idle: sessions that end and start again reuse their pages rather than fault new
// ones in.
TEST(KvBlockPoolTest, IdleSlabsGoBackAtTheSecondLookThatFindsThemIdle) {
  KvBlockPool pool(64 << 20);
  pool.KeepIdleSlabs(true);
  std::vector<unsigned char*> blocks = WrittenBlocks(pool, 3 * kPerSlab);
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), 3 * kPerSlab);
  const unsigned char* first_slab = blocks.front();
  ASSERT_EQ(reinterpret_cast<uintptr_t>(first_slab) % kKvSlabBytes, 0u);
  // The first two slabs emptied go idle; the last stays as its size's room.
  for (unsigned char* block : blocks) pool.Free(block, kBlock);
  EXPECT_EQ(pool.slab_bytes(), 3 * kKvSlabBytes);
  EXPECT_GE(ResidentPages(first_slab, 2 * kKvSlabBytes), 2 * kPerSlab * kBlock / kPage);
  EXPECT_EQ(pool.ReleaseIdleSlabs(), 0);  // idle since this look only
  EXPECT_GE(ResidentPages(first_slab, 2 * kKvSlabBytes), 2 * kPerSlab * kBlock / kPage);
  // Taken again and emptied between two looks, a slab is idle anew: not given back at the next.
  constexpr int64_t kOther = 2 * kBlock;  // 10 a slab
  std::vector<unsigned char*> others;
  for (int64_t i = 0; i <= kKvSlabBytes / kOther; ++i) others.push_back(pool.Allocate(kOther));
  ASSERT_EQ(others.front(), first_slab);  // both idle slabs, for another size
  ASSERT_EQ(others.back(), first_slab + kKvSlabBytes);
  for (size_t i = 0; i + 1 < others.size(); ++i) pool.Free(others[i], kOther);
  EXPECT_EQ(pool.ReleaseIdleSlabs(), 0);
  EXPECT_GE(ResidentPages(first_slab, kKvSlabBytes), (kKvSlabBytes / kOther) * kOther / kPage);
  EXPECT_EQ(pool.ReleaseIdleSlabs(), kKvSlabBytes);
  EXPECT_EQ(ResidentPages(first_slab, kKvSlabBytes), 0);
  pool.Free(others.back(), kOther);                // the second slab, its size's room now
  EXPECT_EQ(pool.slab_bytes(), 2 * kKvSlabBytes);  // one room a size
  EXPECT_EQ(pool.ReleaseIdleSlabs(), 0);
}

// A new slab is an idle one (its pages there) before one whose pages went back.
TEST(KvBlockPoolTest, ANewSlabIsAnIdleOneBeforeOneGivenBack) {
  KvBlockPool pool(64 << 20);
  pool.KeepIdleSlabs(true);
  std::vector<unsigned char*> blocks = WrittenBlocks(pool, 3 * kPerSlab);
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), 3 * kPerSlab);
  unsigned char* first_slab = blocks.front();
  // The first slab emptied (kept as the room), then left idle as the second has room, goes back
  // after two looks; the second, emptied, goes idle as the third has room.
  for (int64_t i = 0; i <= kPerSlab; ++i) pool.Free(blocks[i], kBlock);
  pool.ReleaseIdleSlabs();
  EXPECT_EQ(pool.ReleaseIdleSlabs(), kKvSlabBytes);
  for (int64_t i = kPerSlab + 1; i <= 2 * kPerSlab; ++i) pool.Free(blocks[i], kBlock);
  EXPECT_EQ(pool.slab_bytes(), 2 * kKvSlabBytes);  // the second, idle, and the third
  // A block of another size takes the second slab (its pages are there), not the first.
  constexpr int64_t kOther = 2 * kBlock;
  unsigned char* other = pool.Allocate(kOther);
  ASSERT_EQ(other, first_slab + kKvSlabBytes);
  std::memset(other, 2, kOther);
  EXPECT_EQ(pool.slab_bytes(), 2 * kKvSlabBytes);
  pool.Free(other, kOther);
  for (int64_t i = 2 * kPerSlab + 1; i < 3 * kPerSlab; ++i) pool.Free(blocks[i], kBlock);
}

// Turned off, the pool gives its idle slabs back at once, and then each slab as it empties.
TEST(KvBlockPoolTest, IdleSlabsGoBackWhenNoLongerKept) {
  KvBlockPool pool(64 << 20);
  pool.KeepIdleSlabs(true);
  std::vector<unsigned char*> blocks = WrittenBlocks(pool, 2 * kPerSlab + 1);
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), 2 * kPerSlab + 1);
  const unsigned char* first_slab = blocks.front();
  for (unsigned char* block : blocks) pool.Free(block, kBlock);
  EXPECT_EQ(pool.slab_bytes(), 3 * kKvSlabBytes);  // two idle, the third its size's room
  pool.KeepIdleSlabs(false);
  EXPECT_EQ(pool.slab_bytes(), kKvSlabBytes);
  EXPECT_EQ(ResidentPages(first_slab, 2 * kKvSlabBytes), 0);
  // The third slab (the room kept), the first and a block of the second; each emptied goes
  // back, but the last, kept as the room.
  for (unsigned char*& block : blocks) block = pool.Allocate(kBlock);
  EXPECT_EQ(pool.slab_bytes(), 3 * kKvSlabBytes);
  for (unsigned char* block : blocks) pool.Free(block, kBlock);
  EXPECT_EQ(pool.slab_bytes(), kKvSlabBytes);
  EXPECT_EQ(ResidentPages(first_slab, kKvSlabBytes), 0);
  EXPECT_EQ(ResidentPages(first_slab + 2 * kKvSlabBytes, kKvSlabBytes), 0);
}

// An observer (the server's attnserve_kv_cache_resident_bytes) hears every change of
// slab_bytes: slabs taken, idle, given back, or all given back when no longer kept.
TEST(KvBlockPoolTest, TheObserverHearsEveryChangeOfTheSlabBytes) {
  KvBlockPool pool(64 << 20);
  pool.KeepIdleSlabs(true);
  int64_t heard = -1;
  pool.ObserveSlabBytes([&](int64_t bytes) { heard = bytes; });
  EXPECT_EQ(heard, 0);
  std::vector<unsigned char*> blocks(2 * kPerSlab + 1);
  for (int round = 0; round < 2; ++round) {
    for (unsigned char*& block : blocks) {
      block = pool.Allocate(kBlock);
      EXPECT_EQ(heard, pool.slab_bytes());
    }
    EXPECT_EQ(heard, 3 * kKvSlabBytes);
    for (unsigned char* block : blocks) {
      pool.Free(block, kBlock);
      EXPECT_EQ(heard, pool.slab_bytes());
    }
    EXPECT_EQ(heard, 3 * kKvSlabBytes);  // two idle, and the size's room
    if (round == 0) {
      pool.ReleaseIdleSlabs();
      pool.ReleaseIdleSlabs();
    } else {
      pool.KeepIdleSlabs(false);
    }
    EXPECT_EQ(heard, kKvSlabBytes);
  }
}

// Blocks freed by one thread serve another's next allocations (malloc kept them in the arena
// of the thread that had taken them).
TEST(KvBlockPoolTest, BlocksFreedOnOneThreadServeAnyThreadsNextAllocation) {
  KvBlockPool pool(64 << 20);
  std::vector<unsigned char*> first;
  std::thread([&] {
    for (int64_t i = 0; i < 2 * kPerSlab; ++i) first.push_back(pool.Allocate(kBlock));
  }).join();
  std::thread([&] {
    for (unsigned char* block : first) pool.Free(block, kBlock);
  }).join();
  std::vector<unsigned char*> second;
  std::thread([&] {
    for (int64_t i = 0; i < 2 * kPerSlab; ++i) second.push_back(pool.Allocate(kBlock));
  }).join();
  EXPECT_EQ(std::set<unsigned char*>(first.begin(), first.end()),
            std::set<unsigned char*>(second.begin(), second.end()));
  EXPECT_EQ(pool.slab_bytes(), 2 * kKvSlabBytes);
  for (unsigned char* block : second) pool.Free(block, kBlock);
}

// A block larger than a slab takes adjacent slabs, and they serve other sizes once it is freed.
TEST(KvBlockPoolTest, ABlockLargerThanASlabTakesAdjacentSlabs) {
  KvBlockPool pool(16 << 20);
  const int64_t big = kKvSlabBytes + 64 * 1024;
  unsigned char* small = pool.Allocate(kBlock);  // the first slab, kept as its size's room
  unsigned char* a = pool.Allocate(big);
  unsigned char* b = pool.Allocate(big);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b - a, 2 * kKvSlabBytes);
  std::memset(a, 1, big);
  std::memset(b, 2, big);
  EXPECT_EQ(a[big - 1], 1);
  EXPECT_EQ(pool.slab_bytes(), 5 * kKvSlabBytes);
  pool.Free(a, big);
  pool.Free(b, big);  // both spans empty; the first stays as its size's room
  EXPECT_EQ(pool.slab_bytes(), 3 * kKvSlabBytes);
  pool.Free(small, kBlock);
  // Small blocks fill their kept slab, then take the lowest free slab: b's first.
  std::vector<unsigned char*> smalls;
  for (int64_t i = 0; i < kPerSlab; ++i) smalls.push_back(pool.Allocate(kBlock));
  EXPECT_LT(smalls.back(), a);
  unsigned char* next = pool.Allocate(kBlock);
  EXPECT_EQ(next, b);
  unsigned char* again = pool.Allocate(big);  // from its size's kept span
  EXPECT_EQ(again, a);
  pool.Free(again, big);
  pool.Free(next, kBlock);
  for (unsigned char* block : smalls) pool.Free(block, kBlock);
}

// The empty slab a size keeps goes to another size that finds every other slab held.
TEST(KvBlockPoolTest, ASizesKeptSlabGoesToAnotherThatFindsTheRegionHeld) {
  KvBlockPool pool(4 << 20);
  const int64_t big = kKvSlabBytes + 64 * 1024;
  pool.Free(pool.Allocate(big), big);    // kept: two slabs
  pool.Free(pool.Allocate(8192), 8192);  // kept: one slab
  EXPECT_EQ(pool.slab_bytes(), 3 * kKvSlabBytes);
  int64_t blocks = 0;
  while (pool.Allocate(kBlock) != nullptr) ++blocks;
  EXPECT_EQ(blocks, pool.region_bytes() / kKvSlabBytes * kPerSlab);
  EXPECT_EQ(pool.Allocate(big), nullptr);
  EXPECT_EQ(pool.Allocate(8192), nullptr);
}

// Blocks of one size fill the budget whatever their size: a slab holds two blocks of 768 KiB
// (a quarter of it unused), and a block just over a slab takes two (half of them unused).
TEST(KvBlockPoolTest, BlocksOfAnySizeFillTheBudget) {
  // (width, head_dim): 768 KiB blocks (6144 wide, f32); 2,099,200-byte blocks (16400 wide).
  for (const auto& [width, head_dim] : {std::pair<int64_t, int64_t>{6144, 128}, {16400, 16400}}) {
    KvCacheBudget budget(64 << 20);
    KvSequence seq(width, head_dim, KvPrecision::kF32, &budget);
    absl::Status status;
    for (int64_t length = kKvBlockTokens; status.ok(); length += kKvBlockTokens) {
      status = seq.Reserve(length);
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << width;
    EXPECT_EQ(status.message().find("other sizes"), absl::string_view::npos) << status;
    EXPECT_GT(budget.used(), budget.limit() - seq.block_bytes()) << width;
    EXPECT_EQ(budget.used(), seq.bytes());
  }
}

// When every slab is held by blocks of one size, a block of another size is refused though the
// budget has room, and a sequence that wanted it says why and keeps what it had.
TEST(KvBlockPoolTest, ARegionHeldByOneSizeRefusesAnotherAndTheSequenceSaysWhy) {
  KvCacheBudget budget(4 << 20);  // two slabs, and the spare ones
  const int64_t slabs = budget.pool().region_bytes() / kKvSlabBytes;
  for (int64_t i = 0; i < slabs * kPerSlab; ++i) {  // (left to the pool's end to free)
    ASSERT_NE(budget.pool().Allocate(kBlock), nullptr) << i;
  }
  EXPECT_EQ(budget.pool().Allocate(kBlock), nullptr);
  EXPECT_EQ(budget.pool().slab_bytes(), budget.pool().region_bytes());
  std::atomic<int64_t> bytes{0};
  KvSequence other(64, 64, KvPrecision::kF32, &budget, &bytes);  // 8 KiB blocks
  const absl::Status refused = other.Reserve(1);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("none with room for a block of 8192 bytes"),
            absl::string_view::npos)
      << refused;
  EXPECT_EQ(budget.used(), 0);
  EXPECT_EQ(bytes.load(), 0);
  EXPECT_EQ(other.blocks(), 0);
}

// Sessions filling the budget from several threads and ending on others, four times over: the
// caches never hold more than the budget (and a slab) resident, and give it all back but the
// slab kept for the next block. With idle slabs kept, each round takes those the last left
// while a thread of their own gives them back, and after the last round two looks give back
// all.
class KvBlockPoolThreadsTest : public ::testing::TestWithParam<bool> {};

TEST_P(KvBlockPoolThreadsTest, FillingAndEmptyingTheBudgetFromManyThreadsStaysWithinIt) {
  constexpr int64_t kBudget = int64_t{96} << 20;
  KvCacheBudget budget(kBudget);
  const bool keep_idle = GetParam();
  budget.pool().KeepIdleSlabs(keep_idle);
  // The region's first slab (a fresh pool hands out its lowest block first), kept from now on.
  unsigned char* region = budget.pool().Allocate(kBlock);
  ASSERT_NE(region, nullptr);
  budget.pool().Free(region, kBlock);
  const int64_t region_bytes = budget.pool().region_bytes();
  std::atomic<bool> done{false};
  std::thread releaser([&] {
    while (keep_idle && !done) {
      budget.pool().ReleaseIdleSlabs();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  for (int round = 0; round < 4; ++round) {
    std::vector<std::unique_ptr<KvSequence>> sequences[4];
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        std::vector<float> row(768, 1.0f);
        // Sequences of different lengths, grown a block at a time, until the budget is spent.
        for (int64_t n = 0;; ++n) {
          auto seq = std::make_unique<KvSequence>(768, 64, KvPrecision::kF32, &budget);
          const int64_t length = kKvBlockTokens * (1 + (n + t + round) % 7);
          bool full = false;
          for (int64_t p = 0; p < length && !full; ++p) {
            full = !seq->Reserve(p + 1).ok();
            if (!full) seq->Write(p, row.data(), row.data());
          }
          sequences[t].push_back(std::move(seq));
          if (full) return;
        }
      });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_GT(budget.used(), kBudget - 4 * kBlock);
    EXPECT_LE(budget.pool().slab_bytes(), kBudget + kKvSlabBytes);
    EXPECT_LE(ResidentPages(region, region_bytes) * kPage, kBudget + kKvSlabBytes);
    threads.clear();
    for (int t = 0; t < 4; ++t) {  // each thread ends another's sequences
      threads.emplace_back([&, t] { sequences[(t + 1) % 4].clear(); });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(budget.used(), 0);
    // Idle slabs left to the next round are taken (or given back) while it fills the budget;
    // after the last, two looks give them all back.
    if (keep_idle && round < 3) {
      EXPECT_LE(budget.pool().slab_bytes(), kBudget + kKvSlabBytes);
      continue;
    }
    if (keep_idle) {
      budget.pool().ReleaseIdleSlabs();
      budget.pool().ReleaseIdleSlabs();
    }
    EXPECT_EQ(budget.pool().slab_bytes(), kKvSlabBytes);
    EXPECT_LE(ResidentPages(region, region_bytes) * kPage, kKvSlabBytes);
  }
  done = true;
  releaser.join();
}

INSTANTIATE_TEST_SUITE_P(IdleSlabs, KvBlockPoolThreadsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Kept" : "GivenBackAtOnce";
                         });

}  // namespace
}  // namespace attnserve::core
