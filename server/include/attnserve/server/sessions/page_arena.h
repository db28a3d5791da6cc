// PageArena: the memory of KV-cache pages, apart from malloc's heap.
//
// Pages come from slabs the arena maps itself (2 MiB or one page, whichever
// is larger, in whole 4 KiB pages), so that they never mix with the heap's
// short-lived message buffers: there, evicting and refilling sessions left
// holes no other size could reuse, and the process held ~110 MiB past a
// 64 MiB budget under a flood (BENCHMARKS.md). A freed page's memory is
// handed back to the system at once (madvise), and a slab whose pages are all
// free is unmapped, so the process's resident memory follows the pages in
// use.
//
// Thread-safe: pages are freed from any thread (the last reference to a page
// may be a step's view).
#ifndef ATTNSERVE_SERVER_SESSIONS_PAGE_ARENA_H_
#define ATTNSERVE_SERVER_SESSIONS_PAGE_ARENA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

class PageArena {
 public:
  // Bytes one page of `page_bytes` takes: rounded up to whole 4 KiB pages.
  static int64_t Footprint(int64_t page_bytes);

  PageArena() = default;
  ~PageArena();

  PageArena(const PageArena&) = delete;
  PageArena& operator=(const PageArena&) = delete;

  // A 4 KiB-aligned block of `bytes` (a Footprint), or null when the system
  // has no memory to map. Its contents are undefined.
  char* Allocate(int64_t bytes) ABSL_LOCKS_EXCLUDED(mutex_);

  // Gives back a block Allocate returned for `bytes`.
  void Free(char* block, int64_t bytes) ABSL_LOCKS_EXCLUDED(mutex_);

  // Bytes of slabs mapped now.
  int64_t mapped_bytes() const ABSL_LOCKS_EXCLUDED(mutex_);

  // Block sizes with a slab that has a free block now (each a map entry:
  // sizes are the clients' to choose, through a session's shape).
  int64_t sizes_offered() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  struct Slab {
    char* base;
    int64_t bytes;       // Mapped.
    int64_t page_bytes;  // Each block's.
    int64_t used = 0;
    std::vector<char*> free;
  };

  mutable absl::Mutex mutex_;
  // Every slab by its base address, to find a block's.
  std::map<char*, std::unique_ptr<Slab>> slabs_ ABSL_GUARDED_BY(mutex_);
  // By block size, the slabs with a free block.
  std::map<int64_t, std::set<Slab*>> with_free_ ABSL_GUARDED_BY(mutex_);
  int64_t mapped_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_PAGE_ARENA_H_
