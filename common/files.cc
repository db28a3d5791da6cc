#include "attnserve/common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

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

absl::Status CheckOutputPath(absl::string_view flag, const std::string& path) {
  const auto refused = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " is ", path, ", ", why,
                     "; expected a new or regular file in a writable folder"));
  };
  if (path.empty()) return refused("empty");
  struct stat link;
  if (lstat(path.c_str(), &link) == 0) {
    struct stat target;
    if (stat(path.c_str(), &target) != 0) {
      return refused("a symbolic link to nothing it can reach");
    }
    if (S_ISCHR(target.st_mode)) {
      return access(path.c_str(), W_OK) == 0
                 ? absl::OkStatus()
                 : refused("a device it cannot write");
    }
    if (!S_ISREG(target.st_mode)) return refused(KindOf(target.st_mode));
    if (access(path.c_str(), W_OK) != 0) return refused("not writable");
    return absl::OkStatus();
  }
  const size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "."
                             : slash == 0               ? "/"
                                                        : path.substr(0, slash);
  struct stat info;
  if (stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode) ||
      access(folder.c_str(), W_OK | X_OK) != 0) {
    return refused(absl::StrCat("in ", folder, ", not a writable folder"));
  }
  return absl::OkStatus();
}

absl::Status WriteOutputFile(const std::string& path, absl::string_view bytes) {
  const auto write_all = [&](int fd, const std::string& name) -> absl::Status {
    size_t written = 0;
    while (written < bytes.size()) {
      const ssize_t n =
          write(fd, bytes.data() + written, bytes.size() - written);
      if (n < 0) {
        if (errno == EINTR) continue;
        return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", name));
      }
      written += static_cast<size_t>(n);
    }
    return absl::OkStatus();
  };
  // Through links: the file the link names is replaced, not the link.
  std::string target = path;
  struct stat info;
  if (stat(path.c_str(), &info) == 0) {
    if (S_ISCHR(info.st_mode)) {
      const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
      if (fd < 0) {
        return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
      }
      absl::Status written = write_all(fd, path);
      if (close(fd) != 0 && written.ok()) {
        written =
            absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
      }
      return written;
    }
    if (!S_ISREG(info.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is ", KindOf(info.st_mode),
                       ", expected a new or regular file"));
    }
    char resolved[PATH_MAX];
    if (realpath(path.c_str(), resolved) != nullptr) target = resolved;
  }
  const std::string temporary = absl::StrCat(target, ".", getpid(), ".partial");
  const int fd =
      open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", path));
  }
  absl::Status written = write_all(fd, path);
  if (close(fd) != 0 && written.ok()) {
    written = absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
  }
  if (written.ok() && rename(temporary.c_str(), target.c_str()) != 0) {
    written = absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
  }
  if (!written.ok()) unlink(temporary.c_str());
  return written;
}

}  // namespace attnserve
