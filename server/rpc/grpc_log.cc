#include "attnserve/server/rpc/grpc_log.h"

#include <cstring>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "attnserve/common/echo.h"
#include "attnserve/common/log.h"
#include "grpc/support/log.h"

namespace attnserve {
namespace {

// At most one line from each place in gRPC's sources this often.
constexpr absl::Duration kEvery = absl::Seconds(10);

LogLevel LevelOf(char severity) {
  switch (severity) {
    case 'D':
      return LogLevel::kDebug;
    case 'I':
      return LogLevel::kInfo;
    default:
      return LogLevel::kWarning;
  }
}

// When each place last wrote a line, and the lines not shown since.
class Places {
 public:
  // The count of lines not shown before this one, or -1 if this one is not
  // shown either.
  int64_t Take(absl::string_view file, int line, absl::Time now) {
    absl::MutexLock lock(&mutex_);
    Place& place = places_[{std::string(file), line}];
    if (now - place.shown < kEvery) {
      ++place.hidden;
      return -1;
    }
    place.shown = now;
    return std::exchange(place.hidden, 0);
  }

 private:
  struct Place {
    absl::Time shown = absl::InfinitePast();
    int64_t hidden = 0;
  };
  absl::Mutex mutex_;
  // Bounded by gRPC's sources: a place is a file and a line of them.
  std::map<std::pair<std::string, int>, Place> places_ ABSL_GUARDED_BY(mutex_);
};

Places& AllPlaces() {
  static Places* const places = new Places();
  return *places;
}

void Route(gpr_log_func_args* args) {
  const char severity = gpr_log_severity_string(args->severity)[0];
  const std::string line =
      GrpcLogLine(severity, args->file, args->line, args->message, absl::Now());
  if (!line.empty()) Log(LevelOf(severity), line);
}

}  // namespace

std::string GrpcLogLine(char severity, const char* file, int line,
                        const char* message, absl::Time now) {
  const LogLevel level = LevelOf(severity);
  if (!LogEnabled(level)) return "";
  const char* slash = std::strrchr(file, '/');
  const absl::string_view base = slash != nullptr ? slash + 1 : file;
  int64_t hidden = 0;
  if (!LogEnabled(LogLevel::kDebug)) {
    hidden = AllPlaces().Take(base, line, now);
    if (hidden < 0) return "";
  }
  return absl::StrCat(
      "attnserve: grpc ", std::string(1, severity), " ", base, ":", line, " ",
      EchoText(message),
      hidden > 0 ? absl::StrCat(" (", hidden,
                                " more from there not shown since its last)")
                 : "");
}

void RouteGrpcLogs() { gpr_set_log_function(&Route); }

}  // namespace attnserve
