// The call loop's standby thread and the peer it keeps for each call, on a
// loop of its own serving two test methods over loopback.
#include "attnserve/server/rpc/call_loop.h"

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "free_port.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

constexpr char kEcho[] = "/test.Loop/Echo";
constexpr char kHold[] = "/test.Loop/Hold";
constexpr char kWatch[] = "/test.Loop/Watch";

// What the test's handlers tell the test.
struct Shared {
  // Hold: its handler keeps its io thread busy (running, not asleep) until
  // `release` or a minute has passed.
  absl::Notification hold_started;
  std::atomic<bool> release{false};
  std::atomic<bool> hold_returned{false};
  // Watch: started, and the peers its handler saw once its answer failed
  // (the loop's, and gRPC's).
  absl::Mutex mutex;
  int watch_started ABSL_GUARDED_BY(mutex) = 0;
  std::vector<std::string> done_peers ABSL_GUARDED_BY(mutex);
  std::vector<std::string> done_grpc_peers ABSL_GUARDED_BY(mutex);
};

class Echo final : public ServerCall {
  void OnStart() override { StartRead(&message_); }
  void OnReadDone(bool ok) override {
    if (ok) {
      FinishWithMessage(message_, grpc::Status::OK);
    } else {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "no message"));
    }
  }
  grpc::ByteBuffer message_;
};

class Hold final : public ServerCall {
 public:
  explicit Hold(Shared* shared) : shared_(shared) {}

 private:
  void OnStart() override {
    shared_->hold_started.Notify();
    const absl::Time give_up = absl::Now() + absl::Minutes(1);
    while (!shared_->release.load() && absl::Now() < give_up) {
    }
    shared_->hold_returned.store(true);
    Finish(grpc::Status::OK);
  }
  Shared* const shared_;
};

class Watch final : public ServerCall {
 public:
  explicit Watch(Shared* shared) : shared_(shared) {}

 private:
  // Answers only once gRPC has reported the call cancelled (the loop's other
  // io thread takes that event): the answer's operation then fails, and gRPC
  // forgets the peer.
  void OnStart() override {
    {
      absl::MutexLock lock(&shared_->mutex);
      ++shared_->watch_started;
    }
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    while (!cancelled() && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    Finish(grpc::Status::OK);
  }
  void OnDone() override {
    absl::MutexLock lock(&shared_->mutex);
    shared_->done_peers.push_back(peer());
    shared_->done_grpc_peers.push_back(context().peer());
  }
  Shared* const shared_;
};

class CallLoopTest : public ::testing::Test {
 protected:
  // With `resets_per_second`, a reset guard at that cap.
  void Start(int threads, int resets_per_second = 0) {
    loop_.Handle(kEcho, [] { return std::make_unique<Echo>(); });
    loop_.Handle(kHold, [this] { return std::make_unique<Hold>(&shared_); });
    loop_.Handle(kWatch, [this] { return std::make_unique<Watch>(&shared_); });
    if (resets_per_second > 0) {
      guard_ = std::make_unique<ResetGuard>(resets_per_second);
      loop_.SetResetGuard(guard_.get());
    }
    const int port = testing::FreeLoopbackPort();
    ASSERT_GT(port, 0);
    const std::string address = absl::StrCat("127.0.0.1:", port);
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials());
    loop_.AddTo(builder);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    loop_.Start(threads);
    channel_ = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
  }

  void TearDown() override {
    shared_.release.store(true);
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() +
                        std::chrono::seconds(5));
    }
    loop_.Shutdown();
  }

  // Calls `method` with a small message; the status, within `timeout`.
  grpc::Status Call(const char* method, absl::Duration timeout,
                    grpc::ClientContext* context = nullptr) {
    grpc::ClientContext own;
    if (context == nullptr) context = &own;
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    grpc::Slice text("hello");
    grpc::ByteBuffer request(&text, 1);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub_->UnaryCall(context, method, grpc::StubOptions(), &request, &response,
                     [&done](grpc::Status status) { done.set_value(status); });
    return done.get_future().get();
  }

  // Opens a Watch call without sending a message, waits until its handler has
  // started, and cancels it.
  void OpenAndCancelWatch() {
    int started = 0;
    {
      absl::MutexLock lock(&shared_.mutex);
      started = shared_.watch_started;
    }
    grpc::ClientContext context;
    grpc::CompletionQueue queue;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        stub_->PrepareCall(&context, kWatch, &queue);
    void* tag;
    bool ok;
    call->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(queue.Next(&tag, &ok) && ok);
    {
      absl::MutexLock lock(&shared_.mutex);
      const auto has_started =
          [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared_.mutex) {
            return shared_.watch_started > started;
          };
      ASSERT_TRUE(shared_.mutex.AwaitWithTimeout(absl::Condition(&has_started),
                                                 absl::Seconds(30)));
    }
    context.TryCancel();
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(2));
    ASSERT_TRUE(queue.Next(&tag, &ok));
    queue.Shutdown();
    while (queue.Next(&tag, &ok)) {
    }
  }

  Shared shared_;
  std::unique_ptr<ResetGuard> guard_;  // Outlives the loop.
  CallLoop loop_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

// With its only io thread held in a handler (as gRPC's transport work for a
// flooding connection holds it), the loop still answers another client: the
// standby thread polls beside it. Without the standby the Echo waits for the
// Hold, a minute, past its deadline.
TEST_F(CallLoopTest, StandbyAnswersWhileTheOnlyIoThreadIsHeld) {
  Start(/*threads=*/1);
  ASSERT_TRUE(Call(kEcho, absl::Seconds(30)).ok());
  std::thread hold([this] { Call(kHold, absl::Minutes(2)); });
  if (shared_.hold_started.WaitForNotificationWithTimeout(absl::Seconds(30))) {
    const grpc::Status echo = Call(kEcho, absl::Seconds(30));
    EXPECT_TRUE(echo.ok()) << echo.error_code() << " " << echo.error_message();
    EXPECT_FALSE(shared_.hold_returned.load());
    EXPECT_GT(loop_.standby_events(), 0);
  } else {
    ADD_FAILURE() << "the Hold call did not start within 30 s";
  }
  shared_.release.store(true);
  hold.join();
}

// While the io thread sleeps between calls, the standby leaves the events to
// it: a second poller would cost every call a hand-over. (A turn can outlast
// kStallBefore on a loaded machine, so a few events are allowed.)
TEST_F(CallLoopTest, StandbyStaysOutWhileTheIoThreadSleeps) {
  Start(/*threads=*/1);
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE(Call(kEcho, absl::Seconds(30)).ok());
    absl::SleepFor(CallLoop::kStallBefore / 2);
  }
  // Each call is at least three events (arrival, answer, done).
  EXPECT_LE(loop_.standby_events(), 6);
}

// gRPC forgets the peer of a call whose operation failed ("unknown"); the
// loop keeps the one it saw on arrival, for the handler and the reset guard.
TEST_F(CallLoopTest, KeepsThePeerOfACallWhoseAnswerFailed) {
  Start(/*threads=*/2);
  OpenAndCancelWatch();
  for (int i = 0; i < 300; ++i) {
    {
      absl::MutexLock lock(&shared_.mutex);
      if (!shared_.done_peers.empty()) break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::MutexLock lock(&shared_.mutex);
  ASSERT_EQ(shared_.done_peers.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(shared_.done_peers[0], "ipv4:127.0.0.1:"))
      << shared_.done_peers[0] << "; gRPC's: " << shared_.done_grpc_peers[0];
}

// Calls the client cancels reach the reset guard under the connection's own
// address, which it shuts down once they pass the cap.
TEST_F(CallLoopTest, ResetGuardShutsDownTheConnectionOfCancelledCalls) {
  Start(/*threads=*/2, /*resets_per_second=*/3);
  const ResetGuard& guard = *guard_;
  ASSERT_TRUE(Call(kEcho, absl::Seconds(30)).ok());
  ASSERT_EQ(channel_->GetState(false), GRPC_CHANNEL_READY);
  const absl::Time start = absl::Now();
  // The cap counts a second's cancellations: four within one trip it (a
  // machine too slow for that tries again).
  for (int i = 0; i < 40 && guard.closed() == 0; ++i) OpenAndCancelWatch();
  ASSERT_EQ(guard.closed(), 1) << absl::Now() - start;
  // The shutdown reached the client's connection.
  bool left_ready = false;
  for (int i = 0; i < 100 && !left_ready; ++i) {
    left_ready = channel_->GetState(false) != GRPC_CHANNEL_READY;
    if (!left_ready) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(left_ready);
}

// A client answered more often than it cancels keeps its connection past the
// cap: the loop reports answers to the guard too. Ten cancellations within a
// second trip a cap of 3 without them; a machine too slow to make ten within
// one tries again.
TEST_F(CallLoopTest, ResetGuardKeepsAConnectionAnsweredMoreThanItCancels) {
  Start(/*threads=*/2, /*resets_per_second=*/3);
  const ResetGuard& guard = *guard_;
  ASSERT_TRUE(Call(kEcho, absl::Seconds(30)).ok());
  bool within_a_second = false;
  for (int attempt = 0; attempt < 5 && !within_a_second; ++attempt) {
    // A fresh second for the guard.
    absl::SleepFor(absl::Milliseconds(1100));
    const absl::Time start = absl::Now();
    for (int i = 0; i < 10; ++i) {
      OpenAndCancelWatch();
      // Three answers for each cancellation, so that an answer whose end the
      // loop reports after the next cancellation does not matter.
      for (int j = 0; j < 3; ++j) {
        ASSERT_TRUE(Call(kEcho, absl::Seconds(30)).ok());
      }
    }
    within_a_second = absl::Now() - start < absl::Milliseconds(900);
  }
  if (!within_a_second) GTEST_SKIP() << "no ten cancellations within a second";
  EXPECT_EQ(guard.closed(), 0);
  EXPECT_EQ(channel_->GetState(false), GRPC_CHANNEL_READY);
}

// Refusals are no answers: a client paying for each reset with calls to a
// method the server does not serve (UNIMPLEMENTED, no token needed) is cut
// off at the cap, as one that only resets. (Counted as answers, three a reset
// would have let ten resets through, under four times the cap.) A machine
// too slow for four resets within a second tries again.
TEST_F(CallLoopTest, ResetGuardCountsNoRefusalAsAnAnswer) {
  Start(/*threads=*/2, /*resets_per_second=*/3);
  const ResetGuard& guard = *guard_;
  ASSERT_TRUE(Call(kEcho, absl::Seconds(30)).ok());
  for (int attempt = 0; attempt < 5 && guard.closed() == 0; ++attempt) {
    absl::SleepFor(absl::Milliseconds(1100));  // A fresh second.
    for (int i = 0; i < 10 && guard.closed() == 0; ++i) {
      OpenAndCancelWatch();
      for (int j = 0; j < 3 && guard.closed() == 0; ++j) {
        // UNAVAILABLE once the guard has shut the connection down.
        const grpc::StatusCode code =
            Call("/no.Such/Method", absl::Seconds(30)).error_code();
        EXPECT_TRUE(code == grpc::StatusCode::UNIMPLEMENTED ||
                    code == grpc::StatusCode::UNAVAILABLE)
            << code;
      }
    }
  }
  EXPECT_EQ(guard.closed(), 1);
}

}  // namespace
}  // namespace attnserve
