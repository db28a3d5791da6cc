#include "attnserve/server/rpc/access_log.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/log.h"

namespace attnserve {

namespace {

// The length of the valid UTF-8 character at the start of `text`; 0 if none
// starts there (a stray continuation byte, an overlong form, a surrogate, a
// cut sequence).
size_t Utf8CharLength(absl::string_view text) {
  const auto byte = [&](size_t i) {
    return static_cast<unsigned char>(text[i]);
  };
  const unsigned char lead = byte(0);
  size_t length = 0;
  uint32_t code = 0;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2, code = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3, code = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4, code = lead & 0x07;
  } else {
    return 0;
  }
  if (text.size() < length) return 0;
  for (size_t i = 1; i < length; ++i) {
    if ((byte(i) & 0xC0) != 0x80) return 0;
    code = code << 6 | (byte(i) & 0x3F);
  }
  const bool overlong =
      (length == 3 && code < 0x800) || (length == 4 && code < 0x10000);
  const bool surrogate = code >= 0xD800 && code <= 0xDFFF;
  if (overlong || surrogate || code > 0x10FFFF) return 0;
  return length;
}

// `text` as a JSON string, quotes included: control characters escaped, and
// the Unicode ones that steer a terminal or reorder a line (EchoText's: C1
// controls, bidirectional overrides, line separators, zero-width ones), so
// that `tail` or `less` shows a name as it is; other valid UTF-8 kept, any
// other byte as U+FFFD.
void AppendJsonString(absl::string_view text, std::string* out) {
  out->push_back('"');
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (const std::optional<std::pair<uint32_t, size_t>> invisible =
            InvisibleCharacterAt(text.substr(i))) {
      uint32_t point = invisible->first;
      if (point > 0xFFFF) {  // JSON's surrogate pair.
        point -= 0x10000;
        absl::StrAppendFormat(out, "\\u%04x\\u%04x", 0xD800 + (point >> 10),
                              0xDC00 + (point & 0x3FF));
      } else {
        absl::StrAppendFormat(out, "\\u%04x", point);
      }
      i += invisible->second;
      continue;
    }
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
    } else if (c < 0x20 || c == 0x7F) {
      absl::StrAppendFormat(out, "\\u%04x", c);
    } else if (c < 0x80) {
      out->push_back(static_cast<char>(c));
    } else if (const size_t length = Utf8CharLength(text.substr(i))) {
      out->append(text.data() + i, length);
      i += length;
      continue;
    } else {
      out->append("\\ufffd");
    }
    ++i;
  }
  out->push_back('"');
}

void AppendField(absl::string_view name, absl::string_view text,
                 std::string* out) {
  absl::StrAppend(out, ",\"", name, "\":");
  AppendJsonString(text, out);
}

void AppendField(absl::string_view name, int64_t value, std::string* out) {
  absl::StrAppend(out, ",\"", name, "\":", value);
}

}  // namespace

std::string AccessLogLine(const AccessRecord& record) {
  std::string line = "{\"time\":";
  AppendJsonString(absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", record.time,
                                    absl::UTCTimeZone()),
                   &line);
  AppendField("rpc", record.rpc, &line);
  AppendField("code", absl::StatusCodeToString(record.status.code()), &line);
  if (!record.status.ok()) {
    AppendField("message", record.status.message(), &line);
  }
  AppendField("peer", record.peer, &line);
  if (!record.identity.empty()) AppendField("identity", record.identity, &line);
  if (record.stream_index >= 0) {
    AppendField("stream_index", record.stream_index, &line);
  }
  AppendField("request_bytes", record.request_bytes, &line);
  AppendField("response_bytes", record.response_bytes, &line);
  AppendField("server_us", absl::ToInt64Microseconds(record.server), &line);
  if (record.queue_us) AppendField("queue_us", *record.queue_us, &line);
  if (record.compute_us) AppendField("compute_us", *record.compute_us, &line);
  if (!record.weights.empty()) {
    AppendField("weights", CutText(record.weights, kMaxEchoBytes), &line);
    if (record.weights_version > 0) {
      AppendField("weights_version", record.weights_version, &line);
    }
  }
  if (!record.session.empty()) {
    AppendField("session", CutText(record.session, kMaxEchoBytes), &line);
  }
  if (!record.created_session.empty()) {
    AppendField("created_session", record.created_session, &line);
  }
  if (record.steps > 0) AppendField("steps", record.steps, &line);
  line.append("}\n");
  return line;
}

absl::StatusOr<std::unique_ptr<AccessLog>> AccessLog::Open(
    const std::string& destination) {
  if (destination.empty()) {
    return absl::InvalidArgumentError(
        "access_log is empty, expected stdout, stderr or a file path");
  }
  if (destination == "stdout") {
    return std::unique_ptr<AccessLog>(new AccessLog(STDOUT_FILENO, false));
  }
  if (destination == "stderr") {
    return std::unique_ptr<AccessLog>(new AccessLog(STDERR_FILENO, false));
  }
  // O_NONBLOCK: a FIFO no process reads would otherwise hold start-up until
  // one came (ENXIO instead). Writes then block again: the writer thread
  // waits for a slow reader while lines queue up to kMaxPendingBytes.
  const int fd =
      open(destination.c_str(),
           O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0640);
  if (fd < 0) {
    const int error = errno;
    struct stat info;
    if (error == ENXIO && stat(destination.c_str(), &info) == 0 &&
        S_ISFIFO(info.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "access_log ", destination,
          " is a FIFO no process reads; expected stdout, stderr, a file, or a "
          "FIFO a reader has open"));
    }
    return absl::ErrnoToStatus(
        error, absl::StrCat("access_log: cannot open ", destination));
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int error = errno;
    close(fd);
    return absl::ErrnoToStatus(
        error, absl::StrCat("access_log: cannot open ", destination));
  }
  return std::unique_ptr<AccessLog>(new AccessLog(fd, true));
}

AccessLog::AccessLog(int fd, bool owns_fd)
    : fd_(fd), owns_fd_(owns_fd), writer_([this] { WriteLoop(); }) {}

AccessLog::~AccessLog() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  writer_.join();
  if (owns_fd_) close(fd_);
}

void AccessLog::Write(const AccessRecord& record) {
  std::string line = AccessLogLine(record);
  absl::MutexLock lock(&mutex_);
  if (static_cast<int64_t>(pending_.size() + line.size()) > kMaxPendingBytes) {
    ++dropped_;
    return;
  }
  pending_.append(line);
}

int64_t AccessLog::dropped() const {
  absl::MutexLock lock(&mutex_);
  return dropped_;
}

// Takes everything queued and writes it outside the lock, so that calls
// queue their lines while a slow write goes on.
void AccessLog::WriteLoop() {
  // A reader that went away (stdout piped to a process that exited) fails the
  // write with EPIPE instead of killing the server with SIGPIPE: the signal
  // stays blocked, and pending, on this thread alone.
  sigset_t pipe_signal;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, nullptr);
  std::string batch;
  while (true) {
    bool stopping = false;
    {
      absl::MutexLock lock(&mutex_);
      const auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
        return stopping_ || !pending_.empty();
      };
      mutex_.Await(absl::Condition(&ready));
      batch.clear();
      batch.swap(pending_);
      stopping = stopping_;
    }
    absl::string_view left = batch;
    if (!owns_fd_) {
      // stdout or stderr, which the server's log writes too: whole, under
      // the lock its writer holds (a 4 MiB write to a pipe is not atomic, and
      // a log line landed in the middle of a record).
      left.remove_prefix(left.size() - WriteToStandardStream(fd_, left));
    } else {
      while (!left.empty()) {
        const ssize_t written = ::write(fd_, left.data(), left.size());
        if (written < 0 && errno == EINTR) continue;
        if (written <= 0) break;
        left.remove_prefix(static_cast<size_t>(written));
      }
    }
    if (!left.empty()) {
      // The rest of the batch is lost; count its lines.
      int64_t lines = 0;
      for (char c : left) lines += c == '\n';
      absl::MutexLock lock(&mutex_);
      dropped_ += lines;
    }
    if (stopping) {
      absl::MutexLock lock(&mutex_);
      if (pending_.empty()) return;
    }
  }
}

}  // namespace attnserve
