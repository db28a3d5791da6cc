// The server's log under hostile traffic: gRPC core's own lines quoted,
// escaped and rate-limited (GrpcLogLine), and Log() never blocking the caller
// on a reader that stopped reading.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/common/log.h"
#include "attnserve/server/rpc/grpc_log.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(GrpcLogTest, LinesAreQuotedEscapedAndOneEveryTenSecondsFromAPlace) {
  SetLogLevel(LogLevel::kInfo);
  const absl::Time start = absl::FromUnixSeconds(1'000'000);
  const char* forged =
      "Error parsing metadata: value=1x\n{\"rpc\":\"PutWeights\"}\x1b[31m";
  const std::string first =
      GrpcLogLine('E', "src/core/hpack_parser.cc", 1218, forged, start);
  EXPECT_EQ(first,
            "attnserve: grpc E hpack_parser.cc:1218 \"Error parsing metadata: "
            "value=1x\\n{\\\"rpc\\\":\\\"PutWeights\\\"}\\x1b[31m\"");
  // The same place within 10 s: not shown, counted.
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(GrpcLogLine('E', "src/core/hpack_parser.cc", 1218, forged,
                          start + absl::Seconds(i)),
              "");
  }
  // Another place is shown.
  EXPECT_THAT(GrpcLogLine('E', "src/core/hpack_parser.cc", 1300, "other",
                          start + absl::Seconds(1)),
              StartsWith("attnserve: grpc E hpack_parser.cc:1300 \"other\""));
  // 10 s on: shown, with the count of those not shown.
  EXPECT_THAT(GrpcLogLine('E', "src/core/hpack_parser.cc", 1218, "again",
                          start + absl::Seconds(10)),
              HasSubstr("\"again\" (5 more from there not shown since its "
                        "last)"));
  // A message of a megabyte is cut.
  EXPECT_LT(
      GrpcLogLine('E', "a.cc", 1, std::string(1 << 20, 'x').c_str(), start)
          .size(),
      400u);
  // gRPC's errors are warnings: off at --log_level=error.
  SetLogLevel(LogLevel::kError);
  EXPECT_EQ(GrpcLogLine('E', "b.cc", 1, "x", start), "");
  // At debug every line is shown.
  SetLogLevel(LogLevel::kDebug);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE(GrpcLogLine('E', "c.cc", 1, "x", start), "");
  }
  SetLogLevel(LogLevel::kInfo);
}

// stderr a pipe that nobody reads (a stalled log shipper): Log() returns at
// once, the lines past the queue's 1 MiB are dropped and counted, and the
// count is written where they were dropped, before the next line taken (the
// sanitizer build's CI found it written after that line, at first). Until
// 2026-12-07 a full pipe blocked the thread that logged, gRPC's io thread among
// them.
TEST(LogTest, AReaderThatStopsNeverBlocksTheCaller) {
  SetLogLevel(LogLevel::kInfo);
  FlushLog(absl::Seconds(2));
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const int saved = dup(STDERR_FILENO);
  ASSERT_GE(saved, 0);
  ASSERT_EQ(dup2(pipe_fds[1], STDERR_FILENO), STDERR_FILENO);
  const std::string line(7000, 'w');
  // 2,000 lines of 7 KB: 14 MB, far past the pipe's 64 KiB and the queue.
  std::future<void> logged = std::async(std::launch::async, [&] {
    for (int i = 0; i < 2000; ++i) Log(LogLevel::kWarning, line);
  });
  const bool returned =
      logged.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  // The reader comes back: what it reads ends with the count of those
  // dropped (the writer wrote what it could meanwhile).
  fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  std::string read_back;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  Log(LogLevel::kWarning, "after");
  while (absl::Now() < until &&
         read_back.find("after\n") == std::string::npos) {
    char buffer[65536];
    const ssize_t n = read(pipe_fds[0], buffer, sizeof(buffer));
    if (n > 0) {
      read_back.append(buffer, static_cast<size_t>(n));
    } else {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  FlushLog(absl::Seconds(2));
  dup2(saved, STDERR_FILENO);
  close(saved);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  ASSERT_TRUE(returned) << "Log() blocked on a full pipe";
  logged.get();
  EXPECT_THAT(read_back, HasSubstr(" log lines dropped: the log's reader "
                                   "fell behind by more than 1048576 bytes"));
  EXPECT_THAT(read_back, HasSubstr("after\n"));
}

}  // namespace
}  // namespace attnserve
