// A bounded cache of built oneDNN primitives, keyed by everything that shapes
// them: a repeated request shape skips creating primitive descriptors (tens of
// microseconds each, which a small request would otherwise spend more on than
// on its arithmetic). oneDNN primitives may execute from several threads at
// once, so one cached plan serves concurrent calls. Thread-safe.
#ifndef ATTNSERVE_CORE_INTERNAL_PLAN_CACHE_H_
#define ATTNSERVE_CORE_INTERNAL_PLAN_CACHE_H_

#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace attnserve::internal {

template <typename Plan>
class PlanCache {
 public:
  explicit PlanCache(size_t capacity) : capacity_(capacity) {}

  // The plan for `key`, made by `make` (outside the lock) on a miss. When full,
  // the cache starts over: shapes come and go in bursts, and a bound matters
  // more than recency here.
  std::shared_ptr<const Plan> GetOrCreate(const std::string& key,
                                          absl::FunctionRef<Plan()> make) {
    {
      absl::MutexLock lock(&mutex_);
      const auto it = plans_.find(key);
      if (it != plans_.end()) return it->second;
    }
    auto plan = std::make_shared<const Plan>(make());
    absl::MutexLock lock(&mutex_);
    if (plans_.size() >= capacity_) plans_.clear();
    return plans_.emplace(key, std::move(plan)).first->second;
  }

 private:
  const size_t capacity_;
  absl::Mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<const Plan>> plans_
      ABSL_GUARDED_BY(mutex_);
};

}  // namespace attnserve::internal

#endif  // ATTNSERVE_CORE_INTERNAL_PLAN_CACHE_H_
