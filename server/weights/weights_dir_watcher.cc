#include "attnserve/server/weights/weights_dir_watcher.h"

#include <openssl/evp.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/common/log.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/common/weights_config.h"
#include "attnserve/server/weights/weights_loader.h"
#include "attnserve/server/weights/weights_validator.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace attnserve {
namespace {

// What identifies a folder's state without reading it: where it resolves to,
// and each entry's name, size and modification time.
std::string Fingerprint(const std::string& folder) {
  std::error_code error;
  std::string print = std::filesystem::canonical(folder, error).string();
  std::set<std::string> entries;
  for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
    std::error_code entry_error;
    const auto size =
        entry.is_regular_file(entry_error) ? entry.file_size(entry_error) : 0;
    const auto modified = entry.last_write_time(entry_error);
    entries.insert(absl::StrCat(entry.path().filename().string(), ":", size,
                                ":", modified.time_since_epoch().count()));
  }
  if (error) return "";  // Unreadable: never equal to a readable state.
  for (const std::string& entry : entries) absl::StrAppend(&print, "|", entry);
  return print;
}

// A protobuf output stream that feeds SHA-256 a buffer at a time.
class Sha256Stream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  explicit Sha256Stream(EVP_MD_CTX* context) : context_(context) {}
  ~Sha256Stream() override { Flush(); }

  bool Next(void** data, int* size) override {
    Flush();
    *data = buffer_;
    *size = sizeof(buffer_);
    pending_ = sizeof(buffer_);
    return true;
  }
  void BackUp(int count) override { pending_ -= count; }
  int64_t ByteCount() const override { return hashed_ + pending_; }

 private:
  void Flush() {
    EVP_DigestUpdate(context_, buffer_, static_cast<size_t>(pending_));
    hashed_ += pending_;
    pending_ = 0;
  }

  EVP_MD_CTX* const context_;
  char buffer_[64 << 10];
  int pending_ = 0;  // Bytes of buffer_ handed out and not backed up.
  int64_t hashed_ = 0;
};

std::string NameOf(const std::string& folder) {
  return std::filesystem::path(folder).filename().string();
}

}  // namespace

absl::StatusOr<int64_t> WeightsDigest(const v1::PutWeightsRequest& request) {
  // The serialisation streams through the hash a buffer at a time: a set
  // may be gigabytes, and is already held twice while it loads.
  const std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(
      EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (context == nullptr ||
      EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("cannot start a SHA-256 digest");
  }
  {
    Sha256Stream stream(context.get());
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    request.weights().SerializeToCodedStream(&coded);
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  if (EVP_DigestFinal_ex(context.get(), digest, nullptr) != 1) {
    return absl::InternalError("cannot finish a SHA-256 digest");
  }
  int64_t version = 0;
  for (int i = 0; i < 7; ++i) version = (version << 8) | digest[i];
  return version > 0 ? version : 1;
}

WeightsDirWatcher::WeightsDirWatcher(
    std::string directory, int64_t max_file_bytes, WeightsRegistry* registry,
    std::function<void(const Changes&)> on_change)
    : directory_(std::move(directory)),
      max_file_bytes_(max_file_bytes),
      registry_(registry),
      on_change_(std::move(on_change)) {}

WeightsDirWatcher::~WeightsDirWatcher() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

absl::Status WeightsDirWatcher::Register(const std::string& name,
                                         const std::string& folder,
                                         const std::string& fingerprint) {
  Seen& seen = seen_[name];
  seen.fingerprint = fingerprint;
  // Set again below if this read is refused for room; any other outcome
  // waits for the folder to change.
  seen.refused_for_room_at = -1;
  absl::StatusOr<v1::PutWeightsRequest> request =
      ReadWeightsFolder(folder, max_file_bytes_);
  if (!request.ok()) return request.status();
  ATTNSERVE_ASSIGN_OR_RETURN(
      const WeightsConfig config,
      ReadWeightsConfig(
          (std::filesystem::path(folder) / "config.txt").string()));
  if (after_read_) after_read_(folder);
  // Read in pieces, file by file: a folder swapped meanwhile may have given
  // some files of one version and some of the next. Its state must be the
  // one seen before the read, or nothing is registered (the next scan reads
  // it again).
  if (Fingerprint(folder) != fingerprint) {
    seen.fingerprint.clear();
    return absl::UnavailableError(
        "it changed while it was read; it is read again at the next look");
  }
  ATTNSERVE_ASSIGN_OR_RETURN(const int64_t digest, WeightsDigest(*request));
  const int64_t version = config.version > 0 ? config.version : digest;
  if (version == seen.version && digest == seen.digest) {
    // Touched, not changed: the registry holds these weights already.
    const absl::StatusOr<WeightsRegistry::Entry> held = registry_->Get(name);
    if (held.ok() && held->version == version) return absl::OkStatus();
  }
  // The registry's bytes around the put: a PutWeights or DeleteWeights may
  // run beside it, and the larger of the two is at least what the put met,
  // so a fall below it is never missed.
  const int64_t held_before = registry_->List("", 0).total_bytes;
  const absl::Status put =
      PutWeightsInto(*registry_, *request, version).status();
  if (absl::IsResourceExhausted(put)) {
    // A set over the whole limit waits for its folder to change instead.
    const absl::StatusOr<WeightsShape> shape =
        ValidateProjectionWeights(request->weights(), "weights");
    const bool never_fits =
        shape.ok() && WeightSet::BytesFor(*shape, request->weights()) >
                          registry_->max_total_bytes();
    seen.refused_for_room_at =
        never_fits ? 0
                   : std::max(held_before, registry_->List("", 0).total_bytes);
  }
  ATTNSERVE_RETURN_IF_ERROR(put);
  seen.version = version;
  seen.digest = digest;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> WeightsDirWatcher::LoadAll() {
  absl::MutexLock lock(&mutex_);
  ATTNSERVE_ASSIGN_OR_RETURN(const WeightsDirListing listing,
                             WeightsFolders(directory_));
  // At start-up anything refused stops the server, naming it.
  if (!listing.refused.empty()) return listing.refused.front();
  std::vector<std::string> names;
  for (const std::string& folder : listing.folders) {
    // The fingerprint before the read; a folder changed while it was read is
    // read again (a few times: it is being updated).
    absl::Status status;
    for (int attempt = 0; attempt < 3; ++attempt) {
      status = Register(NameOf(folder), folder, Fingerprint(folder));
      if (!absl::IsUnavailable(status)) break;
    }
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("weights folder ", folder,
                                                      ": ", status.message()));
    }
    names.push_back(NameOf(folder));
  }
  return names;
}

void WeightsDirWatcher::Start(absl::Duration interval) {
  thread_ = std::thread([this, interval] {
    while (!stop_.WaitForNotificationWithTimeout(interval)) Scan();
  });
}

WeightsDirWatcher::Changes WeightsDirWatcher::Scan() {
  Changes changes;
  {
    absl::MutexLock lock(&mutex_);
    absl::StatusOr<WeightsDirListing> listing = WeightsFolders(directory_);
    if (!listing.ok()) {
      // The folder itself is unreadable (mid-update, or gone): keep every
      // set as it is rather than deleting them all.
      Log(LogLevel::kWarning,
          absl::StrCat("attnserve: ", listing.status().message(),
                       "; keeping the weights registered"));
      changes.failed = 1;
    } else {
      // An entry refused fails alone: a refused folder's set keeps its last
      // good version, and the other sets follow their folders.
      std::set<std::string> present(listing->refused_sets.begin(),
                                    listing->refused_sets.end());
      // Each refusal is counted and reported once, as a folder that fails
      // to load is, not at every look while it stays.
      std::set<std::string> refused_now;
      for (const absl::Status& refused : listing->refused) {
        const std::string message(refused.message());
        refused_now.insert(message);
        if (refused_seen_.count(message) > 0) continue;
        ++changes.failed;
        Log(LogLevel::kWarning,
            absl::StrCat("attnserve: ", message, "; keeping what it held"));
      }
      refused_seen_ = std::move(refused_now);
      for (const std::string& folder : listing->folders) {
        present.insert(NameOf(folder));
      }
      // Removed sets go first, so that their room takes the sets that wait
      // for it in the same look.
      for (auto it = seen_.begin(); it != seen_.end();) {
        if (present.count(it->first) > 0) {
          ++it;
          continue;
        }
        // Deleted only if what the registry holds is what the folder gave.
        const absl::StatusOr<WeightsRegistry::Entry> held =
            registry_->Get(it->first);
        if (held.ok() && held->version == it->second.version &&
            registry_->Delete(it->first).ok()) {
          ++changes.removed;
        }
        it = seen_.erase(it);
      }
      for (const std::string& folder : listing->folders) {
        const std::string name = NameOf(folder);
        const std::string fingerprint = Fingerprint(folder);
        const auto it = seen_.find(name);
        if (it != seen_.end() && it->second.fingerprint == fingerprint &&
            (it->second.refused_for_room_at < 0 ||
             registry_->List("", 0).total_bytes >=
                 it->second.refused_for_room_at)) {
          continue;
        }
        const int64_t before = it == seen_.end() ? 0 : it->second.version;
        const absl::Status status = Register(name, folder, fingerprint);
        if (!status.ok()) {
          ++changes.failed;
          Log(LogLevel::kWarning,
              absl::StrCat("attnserve: weights folder ", folder, ": ",
                           status.message(), "; keeping ",
                           before > 0 ? absl::StrCat("version ", before)
                                      : "it unregistered"));
        } else if (seen_[name].version != before) {
          ++changes.registered;
        }
      }
    }
  }
  if (LogEnabled(LogLevel::kDebug)) {
    Log(LogLevel::kDebug,
        absl::StrCat("attnserve: weights_dir ", directory_,
                     " looked at: ", changes.registered, " registered, ",
                     changes.removed, " removed, ", changes.failed, " failed"));
  }
  if (on_change_ &&
      (changes.registered > 0 || changes.removed > 0 || changes.failed > 0)) {
    on_change_(changes);
  }
  return changes;
}

}  // namespace attnserve
