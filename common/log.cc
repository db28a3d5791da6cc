#include "attnserve/common/log.h"

#include <atomic>
#include <cstdio>
#include <string>

namespace attnserve {

namespace {

std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};

constexpr const char* kNames[] = {"debug", "info", "warning", "error"};

}  // namespace

std::optional<LogLevel> ParseLogLevel(absl::string_view name) {
  for (int level = 0; level < 4; ++level) {
    if (name == kNames[level]) return static_cast<LogLevel>(level);
  }
  return std::nullopt;
}

const char* LogLevelName(LogLevel level) {
  return kNames[static_cast<int>(level)];
}

void SetLogLevel(LogLevel level) {
  min_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= min_level.load(std::memory_order_relaxed);
}

void Log(LogLevel level, absl::string_view line) {
  if (!LogEnabled(level)) return;
  std::FILE* stream = level >= LogLevel::kWarning ? stderr : stdout;
  // One fwrite of the whole line: stdio's lock keeps lines from interleaving.
  std::string text(line);
  text.push_back('\n');
  std::fwrite(text.data(), 1, text.size(), stream);
  std::fflush(stream);
}

}  // namespace attnserve
