// The server's own log lines, by level (--log_level): debug and info lines to
// stdout, warnings and errors to stderr, each written whole and flushed.
//
//   Log(LogLevel::kWarning, absl::StrCat("attnserve: weights folder ", ...));
//
// The level is process-wide (AttnServer::Start sets it from
// ServerOptions::log_level); lines below it are not written. Thread-safe.
#ifndef ATTNSERVE_COMMON_LOG_H_
#define ATTNSERVE_COMMON_LOG_H_

#include <optional>

#include "absl/strings/string_view.h"

namespace attnserve {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

// "debug", "info", "warning", "error" → the level; nullopt for anything else.
std::optional<LogLevel> ParseLogLevel(absl::string_view name);
// The level's name, as ParseLogLevel reads it.
const char* LogLevelName(LogLevel level);

// Lines below `level` are dropped from now on. The default is kInfo.
void SetLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// Writes `line` and a newline if `level` is enabled.
void Log(LogLevel level, absl::string_view line);

}  // namespace attnserve

#endif  // ATTNSERVE_COMMON_LOG_H_
