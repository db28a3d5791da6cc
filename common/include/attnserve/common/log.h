// The server's own log lines, by level (--log_level): debug and info lines to
// stdout, warnings and errors to stderr, each written whole, in order, by one
// writer thread: a reader that stops reading (a full pipe) blocks that thread
// alone, never the caller; past 1 MiB waiting, lines are dropped and counted
// (a warning in their place says how many). The process's exit
// waits up to 2 s for the lines still waiting.
//
//   Log(LogLevel::kWarning, absl::StrCat("attnserve: weights folder ", ...));
//
// The level is process-wide (AttnServer::Start sets it from
// ServerOptions::log_level); lines below it are not written. Thread-safe.
#ifndef ATTNSERVE_COMMON_LOG_H_
#define ATTNSERVE_COMMON_LOG_H_

#include <cstddef>
#include <optional>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attnserve {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

// "debug", "info", "warning", "error" → the level; nullopt for anything else.
std::optional<LogLevel> ParseLogLevel(absl::string_view name);
// The level's name, as ParseLogLevel reads it.
const char* LogLevelName(LogLevel level);

// Lines below `level` are dropped from now on. The default is kInfo.
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// Queues `line` and a newline for writing if `level` is enabled.
void Log(LogLevel level, absl::string_view line);

// Waits until the lines queued so far are written, for at most `limit`
// (before writing to stdout or stderr otherwise, to keep the order).
void FlushLog(absl::Duration limit);

// Writes `text` whole to `fd` (stdout or stderr) under the lock that every
// writer of those two holds through a write (the log's, the access log's), so
// that their lines never interleave, even past a pipe's atomic size. Returns
// the bytes not written (a reader gone: EPIPE).
size_t WriteToStandardStream(int fd, absl::string_view text);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_LOG_H_
