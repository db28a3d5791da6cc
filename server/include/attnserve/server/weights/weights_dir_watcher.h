// Keeps the registry's weight sets in step with --weights_dir, so that every
// replica mounting the same folder serves the same sets at the same versions.
//
// Every `interval` the watcher looks at each set folder's files (names,
// inodes, sizes, modification times, modes, owners, where the folder resolves
// to: a Kubernetes volume update swaps a symbolic link). A folder that changed
// is read again and registered at its version (config.txt's `version=N`, else
// one derived from its contents, so that replicas agree without being told):
// the new version replaces the old atomically, and calls running keep the one
// they started with. A folder that disappeared has its set deleted (unless a
// PutWeights has replaced it since). A folder that no longer loads keeps its
// last good version; the failure is counted and reported on stderr, once per
// change.
#ifndef ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_DIR_WATCHER_H_
#define ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_DIR_WATCHER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "attnserve/server/weights/weights_registry.h"

namespace attnserve {

class WeightsDirWatcher {
 public:
  // What a scan did.
  struct Changes {
    // Sets registered: at a new version, or new weights under the same one
    // (a config.txt that keeps its version), or over a PutWeights' set.
    int64_t registered = 0;
    int64_t removed = 0;  // Sets deleted with their folder.
    int64_t failed = 0;   // Changed folders that did not load.
  };

  // Watches `directory` for `registry` (which must outlive the watcher),
  // reading files of at most `max_file_bytes`; `on_change` (may be empty) is
  // called after each scan that changed or failed something.
  WeightsDirWatcher(std::string directory, int64_t max_file_bytes,
                    WeightsRegistry* registry,
                    std::function<void(const Changes&)> on_change);

  WeightsDirWatcher(const WeightsDirWatcher&) = delete;
  WeightsDirWatcher& operator=(const WeightsDirWatcher&) = delete;

  // Stops the scans.
  ~WeightsDirWatcher();

  // Registers every set folder (at start-up); returns their names. Fails on
  // the first folder that does not load, naming it.
  absl::StatusOr<std::vector<std::string>> LoadAll();

  // Scans every `interval` from now on, on a thread of its own.
  void Start(absl::Duration interval);

  // One scan, on the calling thread.
  Changes Scan();

  // Calls `hook` with a folder's path after its files are read and before
  // its state is checked again: a test changes the folder there to show a
  // swap in the middle of a read. Call before LoadAll and Start.
  void SetAfterReadForTesting(std::function<void(const std::string&)> hook) {
    absl::MutexLock lock(&mutex_);
    after_read_ = std::move(hook);
  }

 private:
  // What the watcher last saw of a folder, and the version it registered.
  struct Seen {
    std::string fingerprint;
    int64_t version = 0;  // 0: the folder has never loaded.
    int64_t digest = 0;   // WeightsDigest of what it registered.
    // The registry's bytes when the set last found no room in it (-1: it
    // did not): the folder is read again, unchanged, once they are fewer.
    // 0 for a set larger than the whole limit: read again once it changes.
    int64_t refused_for_room_at = -1;
  };

  // Reads and registers the set in `folder` as `name`, remembering it as
  // `fingerprint`. Returns the registration's outcome; `*put` says whether
  // the registry was written (not for a folder touched, its weights held).
  absl::Status Register(const std::string& name, const std::string& folder,
                        const std::string& fingerprint, bool* put)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Scan's look, under the lock; a file system error the look did not
  // expect (one std::filesystem throws) fails it, keeping every set.
  void Look(Changes& changes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const std::string directory_;
  const int64_t max_file_bytes_;
  WeightsRegistry* const registry_;
  const std::function<void(const Changes&)> on_change_;
  absl::Mutex mutex_;  // One scan at a time.
  std::map<std::string, Seen> seen_ ABSL_GUARDED_BY(mutex_);  // By set name.
  // The entries the last look refused (their messages).
  std::set<std::string> refused_seen_ ABSL_GUARDED_BY(mutex_);
  // Why the last look could not read the folder itself; empty when it could.
  std::string directory_failure_ ABSL_GUARDED_BY(mutex_);
  std::function<void(const std::string&)> after_read_ ABSL_GUARDED_BY(mutex_);
  absl::Notification stop_;
  std::thread thread_;
};

// The first 56 bits of the SHA-256 of a set's weights (their deterministic
// serialisation), at least 1: the version a folder's set registers under
// when its config.txt has no `version=N`, and what tells its contents apart
// when it keeps one.
absl::StatusOr<int64_t> WeightsDigest(const v1::PutWeightsRequest& request);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_WEIGHTS_WEIGHTS_DIR_WATCHER_H_
