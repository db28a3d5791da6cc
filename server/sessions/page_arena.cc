#include "attnserve/server/sessions/page_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <iterator>

namespace attnserve {
namespace {

constexpr int64_t kSystemPage = 4096;
constexpr int64_t kSlabBytes = int64_t{2} << 20;

}  // namespace

int64_t PageArena::Footprint(int64_t page_bytes) {
  return (page_bytes + kSystemPage - 1) / kSystemPage * kSystemPage;
}

PageArena::~PageArena() {
  absl::MutexLock lock(&mutex_);
  for (const auto& [base, slab] : slabs_) {
    munmap(base, static_cast<size_t>(slab->bytes));
  }
}

char* PageArena::Allocate(int64_t bytes) {
  absl::MutexLock lock(&mutex_);
  std::set<Slab*>& open = with_free_[bytes];
  if (open.empty()) {
    const int64_t count = std::max<int64_t>(1, kSlabBytes / bytes);
    const int64_t slab_bytes = count * bytes;
    void* mapped =
        mmap(nullptr, static_cast<size_t>(slab_bytes), PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return nullptr;
    auto slab = std::make_unique<Slab>();
    slab->base = static_cast<char*>(mapped);
    slab->bytes = slab_bytes;
    slab->page_bytes = bytes;
    // Handed out from the front, so that a slab fills in address order.
    for (int64_t i = count - 1; i >= 0; --i) {
      slab->free.push_back(slab->base + i * bytes);
    }
    open.insert(slab.get());
    mapped_ += slab_bytes;
    slabs_.emplace(slab->base, std::move(slab));
  }
  Slab* slab = *open.begin();
  char* block = slab->free.back();
  slab->free.pop_back();
  ++slab->used;
  if (slab->free.empty()) {
    open.erase(slab);
    // No size stays keyed without a slab to offer (sizes are the clients').
    if (open.empty()) with_free_.erase(bytes);
  }
  return block;
}

void PageArena::Free(char* block, int64_t bytes) {
  // The memory goes back to the system now; the address stays the slab's.
  madvise(block, static_cast<size_t>(bytes), MADV_DONTNEED);
  absl::MutexLock lock(&mutex_);
  auto it = std::prev(slabs_.upper_bound(block));
  Slab* slab = it->second.get();
  slab->free.push_back(block);
  --slab->used;
  if (slab->used == 0) {
    const auto open = with_free_.find(slab->page_bytes);
    if (open != with_free_.end()) {
      open->second.erase(slab);
      if (open->second.empty()) with_free_.erase(open);
    }
    munmap(slab->base, static_cast<size_t>(slab->bytes));
    mapped_ -= slab->bytes;
    slabs_.erase(it);
    return;
  }
  if (slab->free.size() == 1) with_free_[slab->page_bytes].insert(slab);
}

int64_t PageArena::mapped_bytes() const {
  absl::MutexLock lock(&mutex_);
  return mapped_;
}

int64_t PageArena::sizes_offered() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(with_free_.size());
}

}  // namespace attnserve
