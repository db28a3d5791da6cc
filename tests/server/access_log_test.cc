// AccessLog: its lines parse as JSON (checked with nlohmann::json, an
// independent parser) whatever bytes a client put in the names; it bounds the
// client's names; it drops and counts lines past its queue when the reader
// stalls; a reader that goes away neither kills the process nor blocks calls;
// its destructor writes what is queued.
#include "attnserve/server/rpc/access_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/time/civil_time.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace attnserve {
namespace {

AccessRecord SomeRecord() {
  AccessRecord record;
  record.time = absl::FromCivil(absl::CivilSecond(2026, 12, 2, 5, 40, 1),
                                absl::UTCTimeZone()) +
                absl::Microseconds(123456);
  record.rpc = "MultiHeadAttention";
  record.status = absl::OkStatus();
  record.peer = "ipv4:127.0.0.1:53312";
  record.identity = "token:000102030405060708090a0b0c0d0e0f";
  record.request_bytes = 1048612;
  record.response_bytes = 524321;
  record.server = absl::Microseconds(2140);
  record.queue_us = 35;
  record.compute_us = 1960;
  record.weights = "llama-l0";
  record.weights_version = 3;
  return record;
}

nlohmann::json Parse(const std::string& line) {
  EXPECT_FALSE(line.empty());
  EXPECT_EQ(line.back(), '\n');
  EXPECT_EQ(line.find('\n'), line.size() - 1) << "one line: " << line;
  return nlohmann::json::parse(line);  // Throws, failing the test, if invalid.
}

TEST(AccessLogLineTest, SaysWhatTheCallDid) {
  const nlohmann::json line = Parse(AccessLogLine(SomeRecord()));
  EXPECT_EQ(line["time"], "2026-12-02T05:40:01.123456Z");
  EXPECT_EQ(line["rpc"], "MultiHeadAttention");
  EXPECT_EQ(line["code"], "OK");
  EXPECT_FALSE(line.contains("message"));
  EXPECT_EQ(line["peer"], "ipv4:127.0.0.1:53312");
  EXPECT_EQ(line["identity"], "token:000102030405060708090a0b0c0d0e0f");
  EXPECT_EQ(line["request_bytes"], 1048612);
  EXPECT_EQ(line["response_bytes"], 524321);
  EXPECT_EQ(line["server_us"], 2140);
  EXPECT_EQ(line["queue_us"], 35);
  EXPECT_EQ(line["compute_us"], 1960);
  EXPECT_EQ(line["weights"], "llama-l0");
  EXPECT_EQ(line["weights_version"], 3);
  for (const char* absent :
       {"session", "created_session", "steps", "stream_index"}) {
    EXPECT_FALSE(line.contains(absent)) << absent;
  }
}

TEST(AccessLogLineTest, AFailedCallCarriesItsCodeAndMessage) {
  AccessRecord record = SomeRecord();
  record.rpc = "Step";
  record.status = absl::FailedPreconditionError(
      "steps[0].expected_length is 7, the layer holds 9");
  record.response_bytes = 0;
  record.queue_us.reset();
  record.compute_us.reset();
  record.weights.clear();
  record.session = "0123abcd";
  record.steps = 4;
  const nlohmann::json line = Parse(AccessLogLine(record));
  EXPECT_EQ(line["code"], "FAILED_PRECONDITION");
  EXPECT_EQ(line["message"],
            "steps[0].expected_length is 7, the layer holds 9");
  EXPECT_EQ(line["session"], "0123abcd");
  EXPECT_EQ(line["steps"], 4);
  EXPECT_FALSE(line.contains("queue_us"));
  EXPECT_FALSE(line.contains("weights"));
}

TEST(AccessLogLineTest, AnyBytesInClientTextStayValidJson) {
  AccessRecord record = SomeRecord();
  // Quotes, a backslash, control characters, DEL, valid UTF-8 (é, €, 😀),
  // then bytes that are not UTF-8: a stray continuation byte, an overlong
  // '/', a surrogate, a cut sequence.
  const std::string hostile =
      std::string(
          "a\"b\\c\n\r\t\x01\x7f d\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80") +
      "\x80" + "\xC0\xAF" + "\xED\xA0\x80" + "\xE2\x82";
  record.weights = hostile;
  record.session = hostile;
  record.status = absl::InvalidArgumentError(hostile);
  const std::string text = AccessLogLine(record);
  const nlohmann::json line = Parse(text);
  const std::string kept = std::string(
      "a\"b\\c\n\r\t\x01\x7f d\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
  const std::string replacement = "\xEF\xBF\xBD";  // U+FFFD
  EXPECT_EQ(line["weights"].get<std::string>().substr(0, kept.size()), kept);
  EXPECT_NE(line["weights"].get<std::string>().find(replacement),
            std::string::npos);
  EXPECT_EQ(line["message"].get<std::string>().substr(0, kept.size()), kept);
  // Nothing but printable ASCII and valid UTF-8 on the line itself.
  for (const char c : text.substr(0, text.size() - 1)) {
    EXPECT_GE(static_cast<unsigned char>(c), 0x20);
  }
}

// Characters that steer a terminal or reorder a line (a C1 CSI, a
// right-to-left override, a line separator, a zero-width space, a tag past
// U+FFFF) are written as JSON escapes: the line shows them as text under
// `tail` or `less` (until 2026-12-07 they went raw), and a JSON reader gets
// them back whole.
TEST(AccessLogLineTest, CharactersThatSteerATerminalAreEscaped) {
  AccessRecord record = SomeRecord();
  const std::string steering = std::string(
                                   "a\xC2\x9B"
                                   "31m") +
                               "b\xE2\x80\xAE"
                               "c\xE2\x80\xA8"
                               "d\xE2\x80\x8B" +
                               "e\xF3\xA0\x80\x81"
                               "f";
  record.weights = steering;
  const std::string text = AccessLogLine(record);
  EXPECT_THAT(text,
              ::testing::HasSubstr("\"weights\":\"a\\u009b31mb\\u202ec\\u2028d"
                                   "\\u200be\\udb40\\udc01f\""));
  EXPECT_EQ(Parse(text)["weights"].get<std::string>(), steering);
}

TEST(AccessLogLineTest, ClientNamesAreCutToTheEchoBound) {
  AccessRecord record = SomeRecord();
  // 300 two-byte characters: cut at 256 bytes, on a character boundary.
  std::string name;
  for (int i = 0; i < 300; ++i) name += "\xC3\xA9";
  record.weights = name;
  record.session = std::string(1 << 20, 's');
  const std::string text = AccessLogLine(record);
  EXPECT_LT(text.size(), 1024u);
  const nlohmann::json line = Parse(text);
  EXPECT_EQ(line["weights"].get<std::string>(), name.substr(0, 256));
  EXPECT_EQ(line["session"].get<std::string>(), std::string(256, 's'));
}

TEST(AccessLogTest, OpenRefusesWhatItCannotWriteTo) {
  EXPECT_EQ(AccessLog::Open("").status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<std::unique_ptr<AccessLog>> missing =
      AccessLog::Open("/nonexistent-folder/access.log");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent-folder/access.log"),
            absl::string_view::npos);
}

TEST(AccessLogTest, AppendsEveryLineToItsFileByTheTimeItIsDestroyed) {
  const std::string path = ::testing::TempDir() + "/access_log_test.log";
  std::remove(path.c_str());
  { std::ofstream(path) << "a line from before\n"; }
  {
    absl::StatusOr<std::unique_ptr<AccessLog>> log = AccessLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status();
    AccessRecord record = SomeRecord();
    for (int i = 0; i < 1000; ++i) {
      record.request_bytes = i;
      (*log)->Write(record);
    }
    EXPECT_EQ((*log)->dropped(), 0);
  }
  std::ifstream file(path);
  std::string text((std::istreambuf_iterator<char>(file)),
                   std::istreambuf_iterator<char>());
  std::vector<std::string> lines =
      absl::StrSplit(text, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 1001u);
  EXPECT_EQ(lines[0], "a line from before");
  for (int i = 0; i < 1000; ++i) {
    EXPECT_EQ(Parse(lines[i + 1] + "\n")["request_bytes"], i);
  }
  std::remove(path.c_str());
}

// A FIFO nobody reads: the writer blocks on it, the queue fills to its
// bound, and lines past it are dropped and counted while Write stays fast.
TEST(AccessLogTest, AStalledReaderCostsDroppedLinesNotMemory) {
  const std::string path = ::testing::TempDir() + "/access_log_test.fifo";
  std::remove(path.c_str());
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0) << errno;
  // Held open for reading (never read) so that the log's open does not block
  // and its writes fill the pipe, then block.
  const int reader = open(path.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  {
    absl::StatusOr<std::unique_ptr<AccessLog>> log = AccessLog::Open(path);
    ASSERT_TRUE(log.ok()) << log.status();
    const int64_t line_bytes =
        static_cast<int64_t>(AccessLogLine(SomeRecord()).size());
    // Enough lines for the pipe (64 KiB) and the queue (4 MiB) twice over.
    const int64_t lines =
        2 * (AccessLog::kMaxPendingBytes + (64 << 10)) / line_bytes;
    const absl::Time start = absl::Now();
    for (int64_t i = 0; i < lines; ++i) (*log)->Write(SomeRecord());
    // Generous: a blocking Write would never return at all.
    EXPECT_LT(absl::Now() - start, absl::Seconds(30));
    EXPECT_GT((*log)->dropped(), lines / 4);
    EXPECT_LE((*log)->dropped(), lines);
    // The destructor must not hang on the stalled pipe: drain it from here
    // while the log finishes.
    std::thread drain([reader] {
      char buffer[1 << 16];
      const absl::Time until = absl::Now() + absl::Seconds(60);
      while (absl::Now() < until) {
        const ssize_t got = read(reader, buffer, sizeof(buffer));
        if (got == 0) return;  // The log closed its end.
        if (got < 0) absl::SleepFor(absl::Milliseconds(1));
      }
    });
    log->reset();
    drain.join();
  }
  close(reader);
  std::remove(path.c_str());
}

// stdout piped to a process that exited: writes fail with EPIPE (counted),
// and SIGPIPE, blocked on the log's thread, does not end the process.
TEST(AccessLogTest, AReaderThatWentAwayIsCountedNotFatal) {
  int pipe_ends[2];
  ASSERT_EQ(pipe(pipe_ends), 0);
  const int saved_stdout = dup(STDOUT_FILENO);
  ASSERT_GE(saved_stdout, 0);
  ASSERT_GE(dup2(pipe_ends[1], STDOUT_FILENO), 0);
  close(pipe_ends[1]);
  close(pipe_ends[0]);  // The reader is gone.
  int64_t dropped = 0;
  {
    absl::StatusOr<std::unique_ptr<AccessLog>> log = AccessLog::Open("stdout");
    ASSERT_TRUE(log.ok()) << log.status();
    for (int i = 0; i < 10; ++i) (*log)->Write(SomeRecord());
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while ((*log)->dropped() < 10 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    dropped = (*log)->dropped();
  }
  dup2(saved_stdout, STDOUT_FILENO);
  close(saved_stdout);
  EXPECT_EQ(dropped, 10);
}

}  // namespace
}  // namespace attnserve
