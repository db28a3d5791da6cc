// A server whose allocations fail where its memory budgets did not foresee it
// (the machine short of memory, a limit below the budgets) answers the call
// RESOURCE_EXHAUSTED and goes on serving: nothing throws out of a handler or a
// compute (which would end the process).
//
// This binary replaces the global operator new: once armed, allocations of at
// least a threshold fail with std::bad_alloc (all of them, or only the n-th),
// except on the test's own thread, whose client builds requests and reads
// answers.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/client/tensors.h"
#include "attnserve/common/allocation_failures.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.grpc.pb.h"
#include "reference/reference_attention.h"
#include "server/metrics_scrape.h"
#include "server/server_fixture.h"

namespace {

// Allocations of at least this many bytes may fail; 0: none does.
std::atomic<int64_t> g_fail_at_least{0};
// The large allocations still to pass before one fails (it fails when this
// reaches 0); negative: every large allocation fails.
std::atomic<int64_t> g_passes_left{-1};
std::atomic<int64_t> g_failed{0};
thread_local bool t_exempt = false;

bool ShouldFail(std::size_t size) {
  const int64_t at_least = g_fail_at_least.load(std::memory_order_relaxed);
  if (at_least <= 0 || t_exempt || static_cast<int64_t>(size) < at_least) {
    return false;
  }
  if (g_passes_left.load(std::memory_order_relaxed) >= 0 &&
      g_passes_left.fetch_sub(1) != 0) {
    return false;
  }
  g_failed.fetch_add(1);
  return true;
}

}  // namespace

// Every form but the aligned ones, so that under AddressSanitizer (which
// defines them all) each block is freed by the family that allocated it.
void* operator new(std::size_t size) {
  if (ShouldFail(size)) throw std::bad_alloc();
  void* block = std::malloc(size == 0 ? 1 : size);
  if (block == nullptr) throw std::bad_alloc();
  return block;
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(size);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept {
  return ::operator new(size, std::nothrow);
}

// GCC sees these free what its own operator new would have allocated.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* block) noexcept { std::free(block); }
void operator delete[](void* block) noexcept { std::free(block); }
void operator delete(void* block, std::size_t) noexcept { std::free(block); }
void operator delete[](void* block, std::size_t) noexcept { std::free(block); }
void operator delete(void* block, const std::nothrow_t&) noexcept {
  std::free(block);
}
void operator delete[](void* block, const std::nothrow_t&) noexcept {
  std::free(block);
}
#pragma GCC diagnostic pop

namespace attnserve::testing {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(60);
constexpr int64_t kLarge = 64 << 10;

// Every large allocation fails from now on.
void FailAll() {
  g_failed.store(0);
  g_passes_left.store(-1);
  g_fail_at_least.store(kLarge);
}

// The large allocation after `passes` others fails, and only it.
void FailAfter(int64_t passes) {
  g_failed.store(0);
  g_passes_left.store(passes);
  g_fail_at_least.store(kLarge);
}

void Disarm() { g_fail_at_least.store(0); }

class AllocationFailureTest : public ServerFixture {
 protected:
  void SetUp() override {
    t_exempt = true;
    ServerOptions options = DefaultOptions();
    options.metrics_port = 0;  // Any free port.
    StartServer(options);
  }
  void TearDown() override { Disarm(); }

  // Runs `call` with the first, second, ... large allocation after its start
  // failing, until a run passes with none failed (the call makes no more).
  // Each answer is OK or RESOURCE_EXHAUSTED naming memory; the server keeps
  // serving. Returns how many runs a failure ended.
  template <typename Call>
  int SweepFailures(Call call, int most_runs) {
    int failed_runs = 0;
    for (int passes = 0; passes < most_runs; ++passes) {
      FailAfter(passes);
      const absl::Status status = call();
      Disarm();
      if (g_failed.load() == 0) {
        EXPECT_TRUE(status.ok()) << status;
        return failed_runs;
      }
      ++failed_runs;
      if (!status.ok()) {
        EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted)
            << "with large allocation " << passes << " failing: " << status;
        EXPECT_NE(status.message().find("memory"), absl::string_view::npos)
            << status;
      }
      const absl::Status after = call();
      EXPECT_TRUE(after.ok()) << "after a failed allocation: " << after;
    }
    ADD_FAILURE() << "the call still made large allocations after "
                  << most_runs;
    return failed_runs;
  }

  static v1::AttendRequest Attend() {
    return RandomAttendRequest({1, 2, 2, 512, 512, 64, 64}, 11);
  }
};

TEST_F(AllocationFailureTest, ParseWithoutMemoryIsResourceExhausted) {
  const v1::AttendRequest request = Attend();
  FailAll();
  const absl::StatusOr<v1::AttendResponse> response =
      client_->Attend(request, kTimeout);
  Disarm();
  EXPECT_GT(g_failed.load(), 0);
  ASSERT_EQ(response.status().code(), absl::StatusCode::kResourceExhausted)
      << response.status();
  EXPECT_NE(response.status().message().find("could not allocate"),
            absl::string_view::npos)
      << response.status();
  const absl::StatusOr<v1::AttendResponse> again =
      client_->Attend(request, kTimeout);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->output().shape_size(), 4);
}

TEST_F(AllocationFailureTest, AttendSurvivesEachFailedAllocation) {
  const v1::AttendRequest request = Attend();
  EXPECT_GE(
      SweepFailures([&] { return client_->Attend(request, kTimeout).status(); },
                    64),
      1);
}

TEST_F(AllocationFailureTest,
       HalfInputsWithWeightsSurviveEachFailedAllocation) {
  const ReferenceShape s{1, 2, 2, 256, 256, 64, 64};
  v1::AttendRequest request;
  const int64_t q = s.batch * s.heads * s.query_len * s.key_dim;
  const int64_t k = s.batch * s.kv_heads * s.key_len * s.key_dim;
  *request.mutable_query() =
      MakeTensor(v1::BFLOAT16, {s.batch, s.heads, s.query_len, s.key_dim},
                 RandomValues(q, 1));
  *request.mutable_key() =
      MakeTensor(v1::BFLOAT16, {s.batch, s.kv_heads, s.key_len, s.key_dim},
                 RandomValues(k, 2));
  *request.mutable_value() =
      MakeTensor(v1::FLOAT16, {s.batch, s.kv_heads, s.key_len, s.value_dim},
                 RandomValues(k, 3));
  request.mutable_options()->set_return_weights(v1::AttentionOptions::PER_HEAD);
  request.mutable_options()->set_return_lse(true);
  request.mutable_options()->set_output_dtype(v1::FLOAT32);
  EXPECT_GE(
      SweepFailures([&] { return client_->Attend(request, kTimeout).status(); },
                    64),
      2);
}

TEST_F(AllocationFailureTest, MultiHeadAttentionSurvivesEachFailedAllocation) {
  v1::MultiHeadAttentionRequest request;
  *request.mutable_query_input() =
      MakeFloat32Tensor({2, 512, 64}, RandomValues(2 * 512 * 64, 5));
  request.set_weights_name("demo");
  EXPECT_GE(
      SweepFailures(
          [&] {
            return client_->MultiHeadAttention(request, kTimeout).status();
          },
          64),
      1);
}

TEST_F(AllocationFailureTest, SessionStepSurvivesEachFailedAllocation) {
  v1::CreateSessionRequest create;
  create.set_num_layers(1);
  create.set_num_heads(2);
  create.set_key_dim(64);
  create.set_dtype(v1::FLOAT32);
  // RoPE: the keys are rotated in a copy before the append, the queries in
  // one after it, so that allocations fail on both sides of the append.
  create.mutable_defaults()->mutable_rope()->set_theta(10000.0f);
  const absl::StatusOr<v1::CreateSessionResponse> created =
      client_->CreateSession(create, kTimeout);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->session().session_id();
  constexpr int64_t kTokens = 512;
  constexpr int64_t kQueryRows = 128;
  int64_t length = 0;
  // Steps that failed after their append, and said so in their own result.
  int failed_after_append = 0;
  // Appends a block of keys and values and attends to the whole cache. A
  // step that failed says what its layer holds: as before it, or with its
  // tokens appended. A call that failed whole after its append (its answer
  // could not be serialised) is a lost answer: the next step's
  // FAILED_PRECONDITION says the layer holds its tokens, as docs/api.md
  // tells clients to recover.
  const auto attempt = [&]() -> absl::Status {
    v1::StepRequest request;
    v1::SessionStep* s = request.add_steps();
    s->set_session_id(id);
    s->set_layer(0);
    s->set_expected_length(length);
    *s->mutable_key() = MakeFloat32Tensor(
        {2, kTokens, 64}, RandomValues(2 * kTokens * 64, length + 1));
    *s->mutable_value() = MakeFloat32Tensor(
        {2, kTokens, 64}, RandomValues(2 * kTokens * 64, length + 2));
    *s->mutable_query() = MakeFloat32Tensor(
        {2, kQueryRows, 64}, RandomValues(2 * kQueryRows * 64, length + 3));
    const absl::StatusOr<v1::StepResponse> response =
        client_->Step(request, kTimeout);
    if (!response.ok()) return response.status();
    if (response->results_size() != 1) {
      return absl::InternalError("not one result");
    }
    const v1::StepResult& result = response->results(0);
    if (result.error().code() ==
            static_cast<int>(absl::StatusCode::kFailedPrecondition) &&
        result.length() == length + kTokens) {
      length = result.length();  // The lost attempt landed.
      return absl::AbortedError("a lost attempt landed; step again");
    }
    if (!result.error().message().empty()) {
      if (result.length() != length && result.length() != length + kTokens) {
        return absl::InternalError(
            absl::StrCat("a failed step says its layer holds ", result.length(),
                         " tokens; it held ", length));
      }
      failed_after_append += result.length() == length + kTokens ? 1 : 0;
      length = result.length();
      return absl::Status(static_cast<absl::StatusCode>(result.error().code()),
                          result.error().message());
    }
    length += kTokens;
    if (result.length() != length) {
      return absl::InternalError(
          absl::StrCat("length ", result.length(), ", expected ", length));
    }
    return absl::OkStatus();
  };
  const auto step = [&]() -> absl::Status {
    const absl::Status status = attempt();
    return absl::IsAborted(status) ? attempt() : status;
  };
  EXPECT_GE(SweepFailures(step, 64), 4);
  EXPECT_GE(failed_after_append, 1);
}

// The Open Inference Protocol's typed contents are packed into tensors, and
// the answer moved into the protocol's response: more places to fail.
TEST_F(AllocationFailureTest, ModelInferSurvivesEachFailedAllocation) {
  inference::ModelInferRequest request;
  request.set_model_name("sdpa");
  const std::vector<std::pair<const char*, std::vector<int64_t>>> inputs = {
      {"QUERY", {1, 2, 256, 64}},
      {"KEY", {1, 2, 256, 64}},
      {"VALUE", {1, 2, 256, 64}}};
  for (const auto& [name, shape] : inputs) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (const int64_t d : shape) input->add_shape(d);
    for (const float value : RandomValues(2 * 256 * 64, input->name()[0])) {
      input->mutable_contents()->add_fp32_contents(value);
    }
  }
  const std::unique_ptr<inference::GRPCInferenceService::Stub> stub =
      inference::GRPCInferenceService::NewStub(client_->channel());
  const auto infer = [&]() -> absl::Status {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kTimeout));
    inference::ModelInferResponse response;
    const grpc::Status status = stub->ModelInfer(&context, request, &response);
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        status.error_message());
  };
  EXPECT_GE(SweepFailures(infer, 64), 2);
}

// Each failure is counted for the operator.
TEST_F(AllocationFailureTest, FailuresAreCounted) {
  const int64_t before = AllocationFailures();
  const v1::AttendRequest request = Attend();
  FailAll();
  EXPECT_FALSE(client_->Attend(request, kTimeout).ok());
  Disarm();
  EXPECT_EQ(AllocationFailures(), before + 1);
  // /metrics samples the count each second.
  const std::string key = "attnserve_allocation_failures_total";
  double exported = -1;
  for (int i = 0; i < 50 && exported != before + 1; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    const std::map<std::string, double> samples =
        Samples(Scrape(server_->metrics_port()));
    if (samples.count(key) != 0) exported = samples.at(key);
  }
  EXPECT_EQ(exported, before + 1);
}

}  // namespace
}  // namespace attnserve::testing
