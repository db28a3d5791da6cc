// Reading the files an operator names (weights, configs, keys, tokens) so that
// a wrong one fails start-up with a clear error instead of hanging it: only
// regular files are read (a FIFO or device is refused, never opened for a
// blocking read), and never more than a stated number of bytes.
#ifndef ATTNSERVE_COMMON_FILES_H_
#define ATTNSERVE_COMMON_FILES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// The whole of the regular file at `path`. NOT_FOUND (or the errno's code) if
// it cannot be opened, INVALID_ARGUMENT if it is not a regular file (a folder,
// FIFO, socket or device: opened without blocking and refused),
// RESOURCE_EXHAUSTED past `max_bytes`. A symbolic link is followed; callers
// that must not follow one check first. Messages name the path, never the
// content.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path,
                                            int64_t max_bytes);

// OK if an output file can be written at `path`, which the option `flag`
// names: a new file in a writable folder, a writable regular file (through
// links) in a writable folder, a character device, or a path under /dev/ or
// /proc/ (/dev/stdout, whatever it is). INVALID_ARGUMENT naming both for a
// folder, a FIFO or socket elsewhere, a link to nothing, or a folder that
// cannot take the file. For checks before a call whose effect stays (a
// session's step) when its outputs cannot be written.
absl::Status CheckOutputPath(absl::string_view flag, const std::string& path);

// Writes `bytes` to `path`. A regular file (or a new one) is written beside
// it and renamed over it, whole or not at all (a failed write leaves the old
// file as it was), keeping its mode and, where the writer may, its owner (a
// hard link to it no longer shares it). A path under /dev/ or /proc/, a
// character device or a FIFO is written in place (a FIFO no one reads fails
// at once rather than waits). A socket or folder is refused
// (INVALID_ARGUMENT); other failures carry their errno's code and name the
// path.
absl::Status WriteOutputFile(const std::string& path, absl::string_view bytes);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_FILES_H_
