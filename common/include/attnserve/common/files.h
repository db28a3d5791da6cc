// Reading the files an operator names (weights, configs, keys, tokens) so that
// a wrong one fails start-up with a clear error instead of hanging it: only
// regular files are read (a FIFO or device is refused, never opened for a
// blocking read), and never more than a stated number of bytes.
#ifndef ATTNSERVE_COMMON_FILES_H_
#define ATTNSERVE_COMMON_FILES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace attnserve {

// The whole of the regular file at `path`. NOT_FOUND (or the errno's code) if
// it cannot be opened, INVALID_ARGUMENT if it is not a regular file (a folder,
// FIFO, socket or device: opened without blocking and refused),
// RESOURCE_EXHAUSTED past `max_bytes`. A symbolic link is followed; callers
// that must not follow one check first. Messages name the path, never the
// content.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path,
                                            int64_t max_bytes);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_FILES_H_
