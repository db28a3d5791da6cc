// PageArena: blocks are whole 4 KiB pages from slabs of its own; a freed
// block's memory leaves the process at once, and an empty slab is unmapped.
#include "attnserve/server/sessions/page_arena.h"

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// The process's resident memory, from /proc/self/statm.
int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

TEST(PageArenaTest, BlocksAreWholeAlignedPagesFromSharedSlabs) {
  EXPECT_EQ(PageArena::Footprint(1), 4096);
  EXPECT_EQ(PageArena::Footprint(4096), 4096);
  EXPECT_EQ(PageArena::Footprint(4097), 8192);
  PageArena arena;
  std::set<char*> blocks;
  for (int i = 0; i < 600; ++i) {  // 600 x 4 KiB: two 2 MiB slabs.
    char* block = arena.Allocate(4096);
    ASSERT_NE(block, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(block) % 4096, 0u);
    std::memset(block, i & 0xff, 4096);
    EXPECT_TRUE(blocks.insert(block).second);
  }
  EXPECT_EQ(arena.mapped_bytes(), 4 * kMiB);
  for (char* block : blocks) arena.Free(block, 4096);
  EXPECT_EQ(arena.mapped_bytes(), 0);
  // A page larger than a slab gets a slab of its own.
  char* big = arena.Allocate(3 * kMiB);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(arena.mapped_bytes(), 3 * kMiB);
  arena.Free(big, 3 * kMiB);
  EXPECT_EQ(arena.mapped_bytes(), 0);
}

// A size keeps no entry once none of its slabs has a free block: an audit
// found every size a session's shape had ever given kept one for good.
TEST(PageArenaTest, NoSizeStaysKeyedWithoutAFreeBlock) {
  PageArena arena;
  std::vector<std::pair<char*, int64_t>> blocks;
  for (int64_t pages = 1; pages <= 300; ++pages) {
    const int64_t bytes = pages * 4096;
    blocks.emplace_back(arena.Allocate(bytes), bytes);
    ASSERT_NE(blocks.back().first, nullptr);
  }
  // Sizes up to 256 pages share 2 MiB slabs, with free blocks left over.
  EXPECT_EQ(arena.sizes_offered(), 256);
  for (const auto& [block, bytes] : blocks) arena.Free(block, bytes);
  EXPECT_EQ(arena.sizes_offered(), 0);
  EXPECT_EQ(arena.mapped_bytes(), 0);
  // A slab's last free block taken: its size is offered no more.
  char* whole = arena.Allocate(2 * kMiB);
  EXPECT_EQ(arena.sizes_offered(), 0);
  arena.Free(whole, 2 * kMiB);
}

TEST(PageArenaTest, FreedBlocksLeaveTheProcessAndAreReused) {
  PageArena arena;
  const int64_t block_bytes = 512 * 1024;
  std::vector<char*> blocks;
  const int64_t before = ResidentBytes();
  for (int i = 0; i < 128; ++i) {  // 64 MiB, written.
    blocks.push_back(arena.Allocate(block_bytes));
    ASSERT_NE(blocks.back(), nullptr);
    std::memset(blocks.back(), 1, static_cast<size_t>(block_bytes));
  }
  const int64_t filled = ResidentBytes();
  EXPECT_GE(filled - before, 60 * kMiB);
  // Every other block freed: no slab empties, yet the memory goes.
  for (size_t i = 0; i < blocks.size(); i += 2) {
    arena.Free(blocks[i], block_bytes);
  }
  EXPECT_EQ(arena.mapped_bytes(), 64 * kMiB);
  EXPECT_LE(ResidentBytes(), filled - 28 * kMiB);
  // New blocks come from the holes, not from new slabs.
  for (size_t i = 0; i < blocks.size(); i += 2) {
    blocks[i] = arena.Allocate(block_bytes);
  }
  EXPECT_EQ(arena.mapped_bytes(), 64 * kMiB);
  for (char* block : blocks) arena.Free(block, block_bytes);
  EXPECT_EQ(arena.mapped_bytes(), 0);
}

}  // namespace
}  // namespace attnserve
