#include "attnserve/common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
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

namespace {

// Paths written in place, whatever they name: the process's own streams
// (/dev/stdout into a pipe, or into a file the shell opened, which a rename
// would replace behind its descriptor) and devices.
bool WrittenInPlace(const std::string& path) {
  return absl::StartsWith(path, "/dev/") || absl::StartsWith(path, "/proc/");
}

// The folder holding `path` ("." for a bare name).
std::string FolderOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "."
         : slash == 0               ? "/"
                                    : path.substr(0, slash);
}

bool WritableFolder(const std::string& folder) {
  struct stat info;
  return stat(folder.c_str(), &info) == 0 && S_ISDIR(info.st_mode) &&
         access(folder.c_str(), W_OK | X_OK) == 0;
}

absl::Status WriteAll(int fd, absl::string_view bytes,
                      const std::string& path) {
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
    }
    written += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

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
    if (WrittenInPlace(path) || S_ISCHR(target.st_mode)) {
      return access(path.c_str(), W_OK) == 0 ? absl::OkStatus()
                                             : refused("not writable");
    }
    if (!S_ISREG(target.st_mode)) return refused(KindOf(target.st_mode));
    if (access(path.c_str(), W_OK) != 0) return refused("not writable");
    // The file is replaced by one written beside it: its folder must take
    // one.
    char resolved[PATH_MAX];
    const std::string file =
        realpath(path.c_str(), resolved) != nullptr ? resolved : path;
    if (!WritableFolder(FolderOf(file))) {
      return refused(
          absl::StrCat("in ", FolderOf(file), ", not a writable folder"));
    }
    return absl::OkStatus();
  }
  if (!WritableFolder(FolderOf(path))) {
    return refused(
        absl::StrCat("in ", FolderOf(path), ", not a writable folder"));
  }
  return absl::OkStatus();
}

absl::Status WriteOutputFile(const std::string& path, absl::string_view bytes) {
  struct stat info;
  const bool exists = stat(path.c_str(), &info) == 0;
  if (exists && !S_ISREG(info.st_mode) && !S_ISCHR(info.st_mode) &&
      !S_ISFIFO(info.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", KindOf(info.st_mode),
                     ", expected a new or regular file"));
  }
  if (WrittenInPlace(path) || (exists && !S_ISREG(info.st_mode))) {
    // O_NONBLOCK: a FIFO without a reader fails (ENXIO) rather than waits;
    // then blocking writes, for a pipe or terminal that fills.
    const int fd =
        open(path.c_str(),
             O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0) {
      return absl::ErrnoToStatus(
          errno, absl::StrCat("cannot open ", path,
                              errno == ENXIO ? " (a FIFO no one reads)" : ""));
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    absl::Status written = WriteAll(fd, bytes, path);
    if (close(fd) != 0 && written.ok()) {
      written = absl::ErrnoToStatus(errno, absl::StrCat("cannot write ", path));
    }
    return written;
  }
  // A regular file, or a new one: written beside it and renamed over it, so
  // that a failed write leaves the old file whole. Through links (the file a
  // link names is replaced, not the link), with the old file's mode and
  // owner where it had them.
  std::string target = path;
  char resolved[PATH_MAX];
  if (exists && realpath(path.c_str(), resolved) != nullptr) target = resolved;
  const std::string temporary = absl::StrCat(target, ".", getpid(), ".partial");
  const int fd =
      open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot create ", path));
  }
  if (exists) {
    fchmod(fd, info.st_mode & 07777);
    if (fchown(fd, info.st_uid, info.st_gid) != 0) {
      // Another owner's file, written by one who may not give files away:
      // it becomes the writer's, as a new file would.
    }
  }
  absl::Status written = WriteAll(fd, bytes, path);
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
