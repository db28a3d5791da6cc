#include "attnserve/server/weights/weights_dir_watcher.h"

#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <new>
#include <set>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/log.h"
#include "attnserve/common/status_macros.h"
#include "attnserve/common/weights_config.h"
#include "attnserve/server/weights/weights_loader.h"
#include "attnserve/server/weights/weights_validator.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace attnserve {
namespace {

using google::protobuf::internal::WireFormatLite;

// What identifies a folder's state without reading it: where it resolves to,
// and each entry's name, inode, size, modification time, mode and owner (a
// file that could not be read is read again once chmod or chown fixed it).
std::string Fingerprint(const std::string& folder) {
  std::error_code error;
  std::string print = std::filesystem::canonical(folder, error).string();
  std::set<std::string> entries;
  // Advanced with an error code: a listing that fails half way (an NFS
  // volume's ESTALE) is unreadable, not an exception on the watcher's thread.
  for (std::filesystem::directory_iterator it(folder, error), end;
       !error && it != end; it.increment(error)) {
    const std::filesystem::directory_entry& entry = *it;
    struct stat status {};
    // Through links, as the files are read (a volume's ..data links).
    if (::stat(entry.path().c_str(), &status) != 0) {
      entries.insert(absl::StrCat(entry.path().filename().string(), ":?"));
      continue;
    }
    entries.insert(
        absl::StrCat(entry.path().filename().string(), ":", status.st_ino, ":",
                     S_ISREG(status.st_mode) ? status.st_size : 0, ":",
                     status.st_mtim.tv_sec, ".", status.st_mtim.tv_nsec, ":",
                     status.st_mode, ":", status.st_uid, ":", status.st_gid));
  }
  if (error) return "";  // Unreadable: never equal to a readable state.
  for (const std::string& entry : entries) absl::StrAppend(&print, "|", entry);
  return print;
}

void HashBytes(EVP_MD_CTX* context, const void* data, size_t size) {
  EVP_DigestUpdate(context, data, size);
}

void HashVarint(EVP_MD_CTX* context, uint64_t value) {
  uint8_t bytes[10];
  const uint8_t* end =
      google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(value,
                                                                    bytes);
  HashBytes(context, bytes, static_cast<size_t>(end - bytes));
}

void HashLengthDelimited(EVP_MD_CTX* context, int field_number,
                         uint64_t length) {
  HashVarint(context,
             WireFormatLite::MakeTag(
                 field_number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));
  HashVarint(context, length);
}

// Copies `field` (singular: a number, a bool or a message) of `from` into
// `to`.
absl::Status CopyScalarOrMessage(const google::protobuf::Message& from,
                                 const google::protobuf::FieldDescriptor* field,
                                 google::protobuf::Message* to) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection& in = *from.GetReflection();
  const google::protobuf::Reflection& out = *to->GetReflection();
  if (field->is_repeated()) {
    return absl::InternalError(
        absl::StrCat("weights field ", field->name(), " is repeated"));
  }
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
      out.SetInt64(to, field, in.GetInt64(from, field));
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_INT32:
      out.SetInt32(to, field, in.GetInt32(from, field));
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_FLOAT:
      out.SetFloat(to, field, in.GetFloat(from, field));
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_BOOL:
      out.SetBool(to, field, in.GetBool(from, field));
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_MESSAGE:
      out.MutableMessage(to, field)->CopyFrom(in.GetMessage(from, field));
      return absl::OkStatus();
    default:
      return absl::InternalError(absl::StrCat("weights field ", field->name(),
                                              " has a type the digest skips"));
  }
}

std::string NameOf(const std::string& folder) {
  return std::filesystem::path(folder).filename().string();
}

}  // namespace

absl::StatusOr<int64_t> WeightsDigest(const v1::PutWeightsRequest& request) {
  const std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(
      EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (context == nullptr ||
      EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("cannot start a SHA-256 digest");
  }
  // The bytes of the weights' deterministic serialisation, written out here:
  // protobuf serialises no message over 2 GiB (it wrote nothing, and every
  // set that large had the digest of nothing), and a set may be larger. Each
  // tensor, in field order: its tag and length, its dtype and shape as
  // protobuf serialises them, then its data's tag, length and bytes, hashed
  // in place. Then the fields after the tensors (heads, RoPE), serialised.
  const v1::ProjectionWeights& weights = request.weights();
  const google::protobuf::Reflection& reflection = *weights.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection.ListFields(weights, &fields);  // In field-number order.
  v1::ProjectionWeights rest;
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->message_type() != v1::Tensor::descriptor()) {
      ATTNSERVE_RETURN_IF_ERROR(CopyScalarOrMessage(weights, field, &rest));
      continue;
    }
    const auto& tensor =
        static_cast<const v1::Tensor&>(reflection.GetMessage(weights, field));
    v1::Tensor frame;
    frame.set_dtype(tensor.dtype());
    *frame.mutable_shape() = tensor.shape();
    const std::string head = frame.SerializeAsString();
    const uint64_t data = tensor.data().size();
    const uint64_t data_field =
        data == 0
            ? 0
            : 1 + google::protobuf::io::CodedOutputStream::VarintSize64(data) +
                  data;
    HashLengthDelimited(context.get(), field->number(),
                        head.size() + data_field);
    HashBytes(context.get(), head.data(), head.size());
    if (data > 0) {
      HashLengthDelimited(context.get(), v1::Tensor::kDataFieldNumber, data);
      HashBytes(context.get(), tensor.data().data(), data);
    }
  }
  const std::string tail = rest.SerializeAsString();
  HashBytes(context.get(), tail.data(), tail.size());
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
                                         const std::string& fingerprint,
                                         bool* put) {
  *put = false;
  Seen& seen = seen_[name];
  seen.fingerprint = fingerprint;
  // Set again below if this read is refused for room; any other outcome
  // waits for the folder to change.
  seen.refused_for_room_at = -1;
  // A name the registry would refuse is refused before its files are read.
  ATTNSERVE_RETURN_IF_ERROR(ValidateWeightsName("name", name));
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
  const absl::Status registered =
      PutWeightsInto(*registry_, &*request, version).status();
  if (absl::IsResourceExhausted(registered)) {
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
  ATTNSERVE_RETURN_IF_ERROR(registered);
  *put = true;
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
      bool put;
      status = Register(NameOf(folder), folder, Fingerprint(folder), &put);
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
    try {
      Look(changes);
    } catch (const std::filesystem::filesystem_error& error) {
      // The calls that can fail take an error code; one that throws all the
      // same fails this look alone (it used to end the process), counted and
      // reported as a folder that fails to load is, and the next look tries
      // again.
      ++changes.failed;
      Log(LogLevel::kWarning,
          absl::StrCat("attnserve: weights_dir ", directory_,
                       " could not be looked at: ", error.what(),
                       "; keeping the weights registered"));
    } catch (const std::bad_alloc&) {
      ++changes.failed;
      Log(LogLevel::kWarning,
          absl::StrCat("attnserve: weights_dir ", directory_,
                       ": out of memory reading a set; keeping the weights "
                       "registered"));
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

void WeightsDirWatcher::Look(Changes& changes) {
  {
    absl::StatusOr<WeightsDirListing> listing = WeightsFolders(directory_);
    if (!listing.ok()) {
      // The folder itself is unreadable (mid-update, or gone): keep every
      // set as it is rather than deleting them all. Reported and counted
      // once while it stays so, as a folder that fails to load is.
      const std::string message(listing.status().message());
      if (message != directory_failure_) {
        Log(LogLevel::kWarning,
            absl::StrCat("attnserve: ", message,
                         "; keeping the weights registered"));
        changes.failed = 1;
        directory_failure_ = message;
      }
    } else {
      if (!directory_failure_.empty()) {
        Log(LogLevel::kInfo, absl::StrCat("attnserve: weights_dir ", directory_,
                                          " can be read again"));
        directory_failure_.clear();
      }
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
        // Deleted only if what the registry holds is what the folder gave
        // (checked and deleted at once: a PutWeights since then stands).
        if (registry_->Delete(it->first, it->second.version).ok()) {
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
        bool put;
        const absl::Status status = Register(name, folder, fingerprint, &put);
        if (!status.ok()) {
          ++changes.failed;
          Log(LogLevel::kWarning,
              absl::StrCat("attnserve: weights folder ", folder, ": ",
                           status.message(), "; keeping ",
                           before > 0 ? absl::StrCat("version ", before)
                                      : "it unregistered"));
        } else if (put) {
          // New weights under the same version count too: the registry's
          // bytes and the metrics that show them moved.
          ++changes.registered;
        }
      }
    }
  }
}

}  // namespace attnserve
