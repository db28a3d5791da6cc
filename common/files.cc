#include "attnserve/common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "not a regular file";
}

}  // namespace

absl::StatusOr<std::string> ReadRegularFile(const std::string& path,
                                            int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("open ", path));
  struct FdCloser {
    int fd;
    ~FdCloser() { close(fd); }
  } closer{fd};
  struct stat info;
  if (fstat(fd, &info) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " is ", KindOf(info.st_mode), ", expected a regular file"));
  }
  if (info.st_size > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(path, " is ", info.st_size, " bytes, over the limit of ",
                     max_bytes, " bytes"));
  }
  std::string bytes(static_cast<size_t>(info.st_size), '\0');
  size_t filled = 0;
  while (filled < bytes.size()) {
    const ssize_t count = read(fd, &bytes[filled], bytes.size() - filled);
    if (count == 0) break;  // The file shrank: the caller parses what is left.
    if (count > 0) {
      filled += static_cast<size_t>(count);
    } else if (errno != EINTR) {
      return absl::ErrnoToStatus(errno, absl::StrCat("read ", path));
    }
  }
  bytes.resize(filled);
  return bytes;
}

}  // namespace attnserve
