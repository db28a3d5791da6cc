// KV-cache sessions through a real server: every session RPC, the property
// that a session's steps equal stateless bottom-right Attends over the same
// keys and values (random page boundaries, forks, truncations, GQA, T and
// Tq > 1, every storage dtype), retries through the expected length,
// NOT_FOUND reasons, ownership between tokens, the KV budget (eviction and
// refusal), sharing by forks, limits and malformed steps.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attnserve/client/client.h"
#include "attnserve/common/dtype.h"
#include "attnserve/core/attention_engine.h"
#include "attnserve/server/server.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reference/tolerance.h"
#include "server/metrics_scrape.h"
#include "server/test_certificates.h"

namespace attnserve {
namespace {

using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::RandomValues;
using ::attnserve::testing::ReferenceAttention;
using ::attnserve::testing::ReferenceOptions;
using ::attnserve::testing::ReferenceShape;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// One layer's keys and values as the server stores them, per kv head.
struct LayerModel {
  std::vector<std::vector<float>> keys, values;  // [Hkv][L * D]
  int64_t length = 0;
};

// What a session holds, kept by the test from what it sent.
struct SessionModel {
  std::string id;
  int64_t heads, kv_heads, dim;
  v1::DType dtype;
  std::vector<LayerModel> layers;
  v1::SessionDefaults defaults;  // The attention variant its steps compute.
};

// The reference's options for a step of `model`: causal, bottom-right, and
// the session's variant.
ReferenceOptions StepReferenceOptions(const SessionModel& model) {
  ReferenceOptions options;
  options.causal = true;
  options.bottom_right = true;
  const v1::SessionDefaults& d = model.defaults;
  if (d.has_window_left()) options.window_left = d.window_left();
  options.num_sink_tokens = d.num_sink_tokens();
  options.alibi_slopes.assign(d.alibi_slopes().begin(), d.alibi_slopes().end());
  if (d.has_softcap()) options.softcap = d.softcap();
  return options;
}

// Every layer of `model` keeps its first `length` tokens, as the server's
// TruncateSession (and a fork's shared prefix) does.
void Truncate(SessionModel& model, int64_t length) {
  for (LayerModel& layer : model.layers) {
    const int64_t keep = std::min(layer.length, length);
    for (auto* rows : {&layer.keys, &layer.values}) {
      for (std::vector<float>& head : *rows) {
        head.resize(static_cast<size_t>(keep * model.dim));
      }
    }
    layer.length = keep;
  }
}

// `values` as stored in `dtype` and read back.
std::vector<float> Stored(const std::vector<float>& values, v1::DType dtype) {
  if (dtype == v1::FLOAT32) return values;
  const DataType type =
      dtype == v1::BFLOAT16 ? DataType::kBFloat16 : DataType::kFloat16;
  std::vector<char> bytes(values.size() * 2);
  ConvertFromFloat32(values.data(), static_cast<int64_t>(values.size()), type,
                     bytes.data());
  std::vector<float> out(values.size());
  ConvertToFloat32(type, bytes.data(), static_cast<int64_t>(values.size()),
                   out.data());
  return out;
}

class SessionsTest : public ::testing::Test {
 protected:
  static ServerOptions Options() {
    ServerOptions options;
    options.address = "127.0.0.1";
    options.port = 0;
    options.metrics_port = 0;
    options.metrics_address = "127.0.0.1";
    options.transport.max_message_bytes = 4 << 20;
    options.engine.max_workspace_bytes = 64 << 20;
    options.sessions.page_tokens = 16;
    options.memory.kv_cache_bytes = 64 << 20;
    options.demo_weights = false;
    return options;
  }

  void Start(const ServerOptions& options) {
    absl::StatusOr<std::unique_ptr<AttnServer>> server =
        AttnServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::AttentionService::NewStub(channel_);
  }

  void SetUp() override { Start(Options()); }

  // StepsEqualStatelessAttendsThroughForksAndTruncations on the server
  // started.
  void RunStepProperty();

  std::unique_ptr<grpc::ClientContext> Context(const std::string& token = "") {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(60));
    if (!token.empty()) {
      context->AddMetadata("authorization", "Bearer " + token);
    }
    return context;
  }

  // One layer, H 2, Dk 8, FLOAT32.
  static v1::CreateSessionRequest SmallSession() {
    v1::CreateSessionRequest create;
    create.set_num_layers(1);
    create.set_num_heads(2);
    create.set_key_dim(8);
    create.set_dtype(v1::FLOAT32);
    return create;
  }

  grpc::Status Create(const v1::CreateSessionRequest& request,
                      v1::CreateSessionResponse* response,
                      const std::string& token = "") {
    return stub_->CreateSession(Context(token).get(), request, response);
  }

  SessionModel NewSession(int64_t layers, int64_t heads, int64_t kv_heads,
                          int64_t dim, v1::DType dtype,
                          const std::string& token = "",
                          const v1::SessionDefaults& defaults = {}) {
    v1::CreateSessionRequest request;
    *request.mutable_defaults() = defaults;
    request.set_num_layers(layers);
    request.set_num_heads(heads);
    request.set_num_kv_heads(kv_heads);
    request.set_key_dim(dim);
    request.set_dtype(dtype);
    v1::CreateSessionResponse response;
    const grpc::Status status = Create(request, &response, token);
    EXPECT_TRUE(status.ok()) << status.error_message();
    SessionModel model{response.session().session_id(),
                       heads,
                       kv_heads,
                       dim,
                       dtype,
                       std::vector<LayerModel>(static_cast<size_t>(layers)),
                       response.session().defaults()};
    for (LayerModel& layer : model.layers) {
      layer.keys.resize(static_cast<size_t>(kv_heads));
      layer.values.resize(static_cast<size_t>(kv_heads));
    }
    return model;
  }

  // A step of `model` appending `tokens` random tokens (0: none) to `layer`
  // and asking `query_len` query rows (0: none), and the model updated with
  // what the server will store.
  v1::SessionStep MakeStep(SessionModel& model, int64_t layer, int64_t tokens,
                           int64_t query_len, uint64_t seed,
                           std::vector<float>* query = nullptr) {
    v1::SessionStep step;
    step.set_session_id(model.id);
    step.set_layer(layer);
    LayerModel& l = model.layers[static_cast<size_t>(layer)];
    step.set_expected_length(l.length);
    if (tokens > 0) {
      const std::vector<float> key =
          RandomValues(model.kv_heads * tokens * model.dim, seed);
      const std::vector<float> value =
          RandomValues(model.kv_heads * tokens * model.dim, seed + 1);
      *step.mutable_key() =
          MakeFloat32Tensor({model.kv_heads, tokens, model.dim}, key);
      *step.mutable_value() =
          MakeFloat32Tensor({model.kv_heads, tokens, model.dim}, value);
      const std::vector<float> stored_key = Stored(key, model.dtype);
      const std::vector<float> stored_value = Stored(value, model.dtype);
      const size_t row = static_cast<size_t>(tokens * model.dim);
      for (size_t h = 0; h < l.keys.size(); ++h) {
        l.keys[h].insert(l.keys[h].end(), stored_key.begin() + h * row,
                         stored_key.begin() + (h + 1) * row);
        l.values[h].insert(l.values[h].end(), stored_value.begin() + h * row,
                           stored_value.begin() + (h + 1) * row);
      }
      l.length += tokens;
    }
    if (query_len > 0) {
      std::vector<float> q =
          RandomValues(model.heads * query_len * model.dim, seed + 2);
      *step.mutable_query() =
          MakeFloat32Tensor({model.heads, query_len, model.dim}, q);
      step.mutable_options()->set_return_lse(true);
      if (query != nullptr) *query = std::move(q);
    }
    return step;
  }

  // Checks a step's output against the reference over the model's layer, and
  // against a stateless Attend of the same keys and values.
  void CheckOutput(const SessionModel& model, int64_t layer,
                   const std::vector<float>& query, int64_t query_len,
                   const v1::StepResult& result) {
    const LayerModel& l = model.layers[static_cast<size_t>(layer)];
    ASSERT_FALSE(result.has_error()) << result.error().message();
    ASSERT_EQ(result.length(), l.length);
    std::vector<float> keys, values;
    for (size_t h = 0; h < l.keys.size(); ++h) {
      keys.insert(keys.end(), l.keys[h].begin(), l.keys[h].end());
      values.insert(values.end(), l.values[h].begin(), l.values[h].end());
    }
    absl::StatusOr<std::vector<float>> output = FloatValues(result.output());
    ASSERT_TRUE(output.ok());
    absl::StatusOr<std::vector<float>> lse = FloatValues(result.lse());
    ASSERT_TRUE(lse.ok());
    const ReferenceOptions options = StepReferenceOptions(model);
    if (l.length > 0) {
      const auto expected =
          ReferenceAttention({1, model.heads, model.kv_heads, query_len,
                              l.length, model.dim, model.dim},
                             query, keys, values, options);
      ExpectNear("output", *output, expected.output, testing::kOutputF32);
      ExpectNear("lse", *lse, expected.lse, testing::kLseF32);
      // The stateless Attend takes the whole cache in one message.
      if (l.length > 2048) return;
      v1::AttendRequest attend;
      *attend.mutable_query() =
          MakeFloat32Tensor({1, model.heads, query_len, model.dim}, query);
      *attend.mutable_key() =
          MakeFloat32Tensor({1, model.kv_heads, l.length, model.dim}, keys);
      *attend.mutable_value() =
          MakeFloat32Tensor({1, model.kv_heads, l.length, model.dim}, values);
      attend.mutable_options()->set_causal(true);
      attend.mutable_options()->set_causal_alignment(
          v1::AttentionOptions::BOTTOM_RIGHT);
      const v1::SessionDefaults& d = model.defaults;
      v1::AttentionOptions& o = *attend.mutable_options();
      if (d.has_window_left()) o.set_window_left(d.window_left());
      o.set_num_sink_tokens(d.num_sink_tokens());
      if (d.alibi_slopes_size() > 0) {
        *o.mutable_alibi_slopes() = MakeFloat32Tensor(
            {model.heads}, std::vector<float>(d.alibi_slopes().begin(),
                                              d.alibi_slopes().end()));
      }
      if (d.has_softcap()) o.set_softcap(d.softcap());
      v1::AttendResponse stateless;
      const grpc::Status status =
          stub_->Attend(Context().get(), attend, &stateless);
      ASSERT_TRUE(status.ok()) << status.error_message();
      const std::vector<float> want = *FloatValues(stateless.output());
      // docs/api.md's promise for an f32 step: 1e-6 relative.
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR((*output)[i], want[i],
                    1e-6 * std::max(1.0f, std::abs(want[i])))
            << "against Attend at " << i;
      }
    }
  }

  grpc::Status Step(const v1::StepRequest& request, v1::StepResponse* response,
                    const std::string& token = "") {
    return stub_->Step(Context(token).get(), request, response);
  }

  std::map<std::string, double> Metrics() {
    return testing::Samples(testing::Scrape(server_->metrics_port()));
  }

  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(SessionsTest, DecodeLoopOverEveryDtype) {
  for (const v1::DType dtype : {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16}) {
    SessionModel model = NewSession(2, 8, 2, 16, dtype);
    // Prefill in chunks without a query, then with one, then decode.
    for (int64_t chunk : {20, 17}) {
      v1::StepRequest request;
      *request.add_steps() = MakeStep(model, 0, chunk, 0, chunk);
      v1::StepResponse response;
      ASSERT_TRUE(Step(request, &response).ok());
      ASSERT_FALSE(response.results(0).has_error());
      EXPECT_EQ(response.results(0).length(), model.layers[0].length);
      EXPECT_FALSE(response.results(0).has_output());
    }
    for (int step = 0; step < 20; ++step) {
      std::vector<float> query;
      v1::StepRequest request;
      *request.add_steps() =
          MakeStep(model, 0, step == 0 ? 5 : 1, step == 0 ? 3 : 1,
                   1000 + static_cast<uint64_t>(step), &query);
      v1::StepResponse response;
      ASSERT_TRUE(Step(request, &response).ok());
      ASSERT_NO_FATAL_FAILURE(
          CheckOutput(model, 0, query, step == 0 ? 3 : 1, response.results(0)));
      EXPECT_GT(response.timing().server_us(), 0);
    }
    v1::GetSessionRequest get;
    get.set_session_id(model.id);
    v1::GetSessionResponse got;
    ASSERT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
    EXPECT_THAT(got.session().lengths(), ::testing::ElementsAre(61, 0));
    EXPECT_EQ(got.session().dtype(), dtype);
    // 61 tokens in pages of 16: 4 pages of 16 tokens x 2 heads x (16 + 16)
    // elements, each charged as its whole 4 KiB (f32: exactly 4 KiB).
    EXPECT_EQ(got.session().bytes(), 4 * 4096);
  }
}

// The property: random appends, queries, forks and truncations over several
// sessions, batched into multi-session calls, each query's output equal to
// the reference and to a stateless Attend of what the session holds; with
// the keys stored by dimension and as rows, whichever this CPU prefers, and
// as rows on the AVX2 code (what CPUs without AVX-512 run) where it has AVX2.
TEST_F(SessionsTest, StepsEqualStatelessAttendsThroughForksAndTruncations) {
  EngineOptions avx2;
  avx2.avx2_kernels = true;
  const bool has_avx2 = AttentionEngine::Create(avx2).ok();
  struct Run {
    const char* name;
    bool keys_transposed;
    bool avx2_kernels;
  };
  for (const Run& run : {Run{"keys by dimension", true, false},
                         Run{"keys as rows", false, false},
                         Run{"keys as rows, AVX2 code", false, true}}) {
    if (run.avx2_kernels && !has_avx2) continue;
    SCOPED_TRACE(run.name);
    ServerOptions options = Options();
    options.sessions.keys_transposed = run.keys_transposed;
    options.engine.avx2_kernels = run.avx2_kernels;
    Start(options);
    RunStepProperty();
  }
}

void SessionsTest::RunStepProperty() {
  std::mt19937_64 rng(42);
  const auto uniform = [&rng](int64_t low, int64_t high) {
    return std::uniform_int_distribution<int64_t>(low, high)(rng);
  };
  const v1::DType dtypes[] = {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16};
  std::vector<SessionModel> sessions;
  for (int i = 0; i < 3; ++i) {
    const int64_t kv_heads = uniform(1, 2);
    // Head dims of 8, 16 and 32: the kernel's eight- and sixteen-lane
    // paths on AVX-512.
    sessions.push_back(NewSession(2, kv_heads * uniform(1, 3), kv_heads,
                                  int64_t{8} << uniform(0, 2), dtypes[i]));
  }
  uint64_t seed = 1;
  for (int round = 0; round < 40; ++round) {
    const int64_t op = uniform(0, 9);
    if (op == 0 && sessions.size() < 8) {  // Fork
      SessionModel& parent =
          sessions[static_cast<size_t>(uniform(0, sessions.size() - 1))];
      v1::ForkSessionRequest fork;
      fork.set_session_id(parent.id);
      const int64_t length = uniform(0, parent.layers[0].length + 5);
      fork.set_length(length);
      v1::ForkSessionResponse forked;
      ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
      SessionModel child = parent;
      child.id = forked.session().session_id();
      EXPECT_EQ(forked.session().forked_from(), parent.id);
      Truncate(child, length);
      sessions.push_back(child);
      continue;
    }
    if (op == 1) {  // Truncate
      SessionModel& model =
          sessions[static_cast<size_t>(uniform(0, sessions.size() - 1))];
      const int64_t length = uniform(0, model.layers[0].length);
      v1::TruncateSessionRequest truncate;
      truncate.set_session_id(model.id);
      truncate.set_length(length);
      v1::TruncateSessionResponse truncated;
      ASSERT_TRUE(
          stub_->TruncateSession(Context().get(), truncate, &truncated).ok());
      Truncate(model, length);
      continue;
    }
    // A call of 1 to 4 steps over random sessions and layers (a session and
    // layer may come twice: the later step sees the earlier one's tokens).
    v1::StepRequest request;
    struct Asked {
      size_t session;
      int64_t layer, query_len;
      std::vector<float> query;
      std::vector<LayerModel> after;  // The layer as the step sees it.
    };
    std::vector<Asked> asked;
    const int64_t steps = uniform(1, 4);
    for (int64_t s = 0; s < steps; ++s) {
      const size_t which = static_cast<size_t>(uniform(0, sessions.size() - 1));
      SessionModel& model = sessions[which];
      const int64_t layer = uniform(0, 1);
      const int64_t tokens = uniform(0, 3) == 0 ? 0 : uniform(1, 40);
      const int64_t query_len = tokens == 0          ? uniform(1, 4)
                                : uniform(0, 2) == 0 ? 0
                                                     : uniform(1, tokens + 2);
      Asked a{which, layer, query_len, {}, {}};  // NOLINT
      *request.add_steps() =
          MakeStep(model, layer, tokens, query_len, seed += 3, &a.query);
      a.after = model.layers;
      asked.push_back(std::move(a));
    }
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    ASSERT_EQ(response.results_size(), steps);
    for (int64_t s = 0; s < steps; ++s) {
      const Asked& a = asked[static_cast<size_t>(s)];
      SessionModel seen = sessions[a.session];
      seen.layers = a.after;
      SCOPED_TRACE(absl::StrCat("round ", round, " step ", s));
      if (a.query_len == 0) {
        ASSERT_FALSE(response.results(s).has_error())
            << response.results(s).error().message();
        EXPECT_EQ(response.results(s).length(),
                  seen.layers[static_cast<size_t>(a.layer)].length);
        continue;
      }
      ASSERT_NO_FATAL_FAILURE(CheckOutput(seen, a.layer, a.query, a.query_len,
                                          response.results(s)));
    }
  }
}

// Sessions whose steps compute a window, sinks, ALiBi and a softcap (each
// drawn), prefilled in chunks and decoded, every output equal to the
// reference and to a stateless Attend with the same options.
TEST_F(SessionsTest, VariantStepsEqualStatelessAttends) {
  std::mt19937_64 rng(22);
  const auto uniform = [&rng](int64_t low, int64_t high) {
    return std::uniform_int_distribution<int64_t>(low, high)(rng);
  };
  uint64_t seed = 7;
  for (int round = 0; round < 8; ++round) {
    const int64_t kv_heads = uniform(1, 2);
    const int64_t heads = kv_heads * uniform(1, 3);
    v1::SessionDefaults defaults;
    if (uniform(0, 3) > 0) defaults.set_window_left(uniform(0, 40));
    if (uniform(0, 1) == 1) defaults.set_num_sink_tokens(uniform(1, 20));
    if (uniform(0, 1) == 1) {
      for (int64_t h = 0; h < heads; ++h) {
        defaults.add_alibi_slopes(0.5f / static_cast<float>(h + 1));
      }
    }
    if (uniform(0, 1) == 1) defaults.set_softcap(uniform(0, 1) ? 1.5f : 20.0f);
    const v1::DType dtype = round % 2 == 0 ? v1::FLOAT32 : v1::BFLOAT16;
    SessionModel model = NewSession(1, heads, kv_heads, 8, dtype, "", defaults);
    SCOPED_TRACE(
        absl::StrCat("round ", round, ": ", model.defaults.ShortDebugString()));
    for (int step = 0; step < 12; ++step) {
      const int64_t tokens = step < 3 ? uniform(10, 60) : 1;
      const int64_t query_len = step < 3 ? uniform(1, tokens) : 1;
      std::vector<float> query;
      v1::StepRequest request;
      *request.add_steps() =
          MakeStep(model, 0, tokens, query_len, seed += 3, &query);
      v1::StepResponse response;
      ASSERT_TRUE(Step(request, &response).ok());
      ASSERT_NO_FATAL_FAILURE(
          CheckOutput(model, 0, query, query_len, response.results(0)));
    }
  }
}

// StreamingLLM: a session that keeps only its sinks and window holds the
// same pages after 100,737 tokens as after its first window's worth, and its
// steps still equal the reference over every token sent.
TEST_F(SessionsTest, AnEvictingSessionHoldsBoundedPagesForever) {
  v1::SessionDefaults defaults;
  defaults.set_window_left(48);
  defaults.set_num_sink_tokens(4);
  defaults.set_evict_outside_window(true);
  v1::CreateSessionRequest create = SmallSession();
  *create.mutable_defaults() = defaults;
  v1::CreateSessionResponse created;
  ASSERT_TRUE(Create(create, &created).ok());
  SessionModel model{created.session().session_id(),
                     2,
                     2,
                     8,
                     v1::FLOAT32,
                     std::vector<LayerModel>(1),
                     created.session().defaults()};
  model.layers[0].keys.resize(2);
  model.layers[0].values.resize(2);
  EXPECT_TRUE(model.defaults.evict_outside_window());

  const auto held_bytes = [&] {
    v1::GetSessionRequest get;
    get.set_session_id(model.id);
    v1::GetSessionResponse got;
    EXPECT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
    return got.session().bytes();
  };
  // Pages of 16 tokens, each 16 x 2 heads x (8 + 8) x 4 bytes, charged 4 KiB:
  // the sinks' page, the window's 48 keys over at most 4 pages, and the
  // pages of the step's own tokens.
  int64_t most_bytes = 0;
  uint64_t seed = 100;
  for (int chunk = 0; chunk < 101; ++chunk) {
    // 997 tokens a step (pages do not line up with steps), then a query of
    // the step's last 3 tokens.
    std::vector<float> query;
    v1::StepRequest request;
    *request.add_steps() = MakeStep(model, 0, 997, 3, seed += 3, &query);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    if (chunk % 25 == 0 || chunk == 100) {
      ASSERT_NO_FATAL_FAILURE(
          CheckOutput(model, 0, query, 3, response.results(0)));
    } else {
      ASSERT_FALSE(response.results(0).has_error());
    }
    const int64_t bytes = held_bytes();
    most_bytes = std::max(most_bytes, bytes);
    EXPECT_LE(bytes, (1 + 5) * 4096) << "after chunk " << chunk;
  }
  EXPECT_EQ(model.layers[0].length, 100697);
  // Decode steps: one token each, the held pages the same few.
  for (int step = 0; step < 40; ++step) {
    std::vector<float> query;
    v1::StepRequest request;
    *request.add_steps() = MakeStep(model, 0, 1, 1, seed += 3, &query);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    if (step % 10 == 0) {
      ASSERT_NO_FATAL_FAILURE(
          CheckOutput(model, 0, query, 1, response.results(0)));
    }
    EXPECT_LE(held_bytes(), (1 + 5) * 4096);
  }

  // What needs the freed keys is refused, naming them; nothing changes.
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(model.id);
  truncate.set_length(50000);
  v1::TruncateSessionResponse truncated;
  grpc::Status status =
      stub_->TruncateSession(Context().get(), truncate, &truncated);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(),
              HasSubstr("a truncation to 50000: the next token sees the keys "
                        "from 49952 on"));
  v1::ForkSessionRequest fork;
  fork.set_session_id(model.id);
  fork.set_length(70000);
  v1::ForkSessionResponse forked;
  status = stub_->ForkSession(Context().get(), fork, &forked);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("freed keys"));
  fork.clear_length();
  ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
  // A query reaching further back than the window kept fails alone: the
  // other step of the call is served.
  v1::StepRequest request;
  std::vector<float> query;
  *request.add_steps() = MakeStep(model, 0, 0, 80, seed += 3);
  SessionModel child = model;
  child.id = forked.session().session_id();
  *request.add_steps() = MakeStep(child, 0, 1, 1, seed += 3, &query);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  EXPECT_EQ(response.results(0).error().code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(response.results(0).error().message(),
              HasSubstr("the step's first query row (position 100657) sees "
                        "the keys from 100609 on"));
  ASSERT_NO_FATAL_FAILURE(CheckOutput(child, 0, query, 1, response.results(1)));
}

// With window_left 0 every page behind the next token goes. A truncation or a
// fork back into such a page is allowed (the next token sees only itself),
// and the next append writes to a fresh page, not the freed one.
TEST_F(SessionsTest, AWindowOfZeroTruncatesAndForksBackIntoFreedPages) {
  v1::SessionDefaults defaults;
  defaults.set_window_left(0);
  defaults.set_evict_outside_window(true);
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32, "", defaults);
  uint64_t seed = 300;
  v1::StepRequest prefill;
  *prefill.add_steps() = MakeStep(model, 0, 32, 0, seed += 3);  // 2 pages.
  v1::StepResponse prefilled;
  ASSERT_TRUE(Step(prefill, &prefilled).ok());
  ASSERT_FALSE(prefilled.results(0).has_error())
      << prefilled.results(0).error().message();
  v1::ForkSessionRequest fork;
  fork.set_session_id(model.id);
  fork.set_length(24);  // Halfway into the freed second page.
  v1::ForkSessionResponse forked;
  grpc::Status status = stub_->ForkSession(Context().get(), fork, &forked);
  ASSERT_TRUE(status.ok()) << status.error_message();
  SessionModel child = model;
  child.id = forked.session().session_id();
  Truncate(child, 24);
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(model.id);
  truncate.set_length(24);
  v1::TruncateSessionResponse truncated;
  status = stub_->TruncateSession(Context().get(), truncate, &truncated);
  ASSERT_TRUE(status.ok()) << status.error_message();
  Truncate(model, 24);
  for (SessionModel* m : {&model, &child}) {
    for (int step = 0; step < 3; ++step) {
      std::vector<float> query;
      v1::StepRequest request;
      *request.add_steps() = MakeStep(*m, 0, 5, 2, seed += 3, &query);
      v1::StepResponse response;
      ASSERT_TRUE(Step(request, &response).ok());
      ASSERT_NO_FATAL_FAILURE(
          CheckOutput(*m, 0, query, 2, response.results(0)));
    }
  }

  // Truncated back to 20 and one token appended: the fresh page's first keys
  // (16 to 19) were never appended to it. A query whose first row reaches
  // them is refused, not answered from the page's zeros.
  Truncate(model, 20);
  truncate.set_length(20);
  ASSERT_TRUE(
      stub_->TruncateSession(Context().get(), truncate, &truncated).ok());
  v1::StepRequest append;
  *append.add_steps() = MakeStep(model, 0, 1, 1, seed += 3);
  v1::StepResponse appended;
  ASSERT_TRUE(Step(append, &appended).ok());
  ASSERT_FALSE(appended.results(0).has_error())
      << appended.results(0).error().message();
  for (const int64_t length : {int64_t{21}, int64_t{18}}) {
    if (length < 21) {  // Truncated into the zeros, then asked again.
      Truncate(model, length);
      truncate.set_length(length);
      ASSERT_TRUE(
          stub_->TruncateSession(Context().get(), truncate, &truncated).ok());
    }
    v1::StepRequest reach_back;
    // Rows from position 16 on.
    *reach_back.add_steps() = MakeStep(model, 0, 0, length - 16, seed += 3);
    v1::StepResponse refused;
    ASSERT_TRUE(Step(reach_back, &refused).ok());
    EXPECT_EQ(refused.results(0).error().code(),
              grpc::StatusCode::FAILED_PRECONDITION)
        << "at length " << length;
    EXPECT_THAT(refused.results(0).error().message(),
                HasSubstr("freed keys 16 to " +
                          std::to_string(std::min<int64_t>(19, length - 1))));
    // A query-only step appended nothing, and says so.
    EXPECT_THAT(refused.results(0).error().message(),
                HasSubstr("; nothing was appended or computed"));
  }
}

// With eviction on, the keys the last token saw are kept: a client that lost
// a decode step's answer asks for it again (a query-only step of one row),
// even where the next token's window starts on a page boundary.
TEST_F(SessionsTest, AnEvictingSessionAnswersItsLastTokenAgain) {
  v1::SessionDefaults defaults;
  defaults.set_window_left(4);
  defaults.set_evict_outside_window(true);
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32, "", defaults);
  uint64_t seed = 500;
  // 20 tokens: the last sees keys 15 to 19, the next 16 to 20, a page's start.
  std::vector<float> query;
  v1::StepRequest request;
  *request.add_steps() = MakeStep(model, 0, 20, 1, seed += 3, &query);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  ASSERT_NO_FATAL_FAILURE(CheckOutput(model, 0, query, 1, response.results(0)));
  v1::StepRequest again;
  v1::SessionStep* step = again.add_steps();
  *step = request.steps(0);  // The same query and options, no keys.
  step->clear_key();
  step->clear_value();
  step->set_expected_length(20);
  v1::StepResponse answered;
  ASSERT_TRUE(Step(again, &answered).ok());
  ASSERT_FALSE(answered.results(0).has_error())
      << answered.results(0).error().message();
  ASSERT_NO_FATAL_FAILURE(CheckOutput(model, 0, query, 1, answered.results(0)));
}

// Sinks past any length (up to 2^63 − 1) with eviction on: every key is a
// sink, and none goes.
TEST_F(SessionsTest, SinksNearTheLargestCountKeepEveryKey) {
  v1::SessionDefaults defaults;
  defaults.set_window_left(1);
  defaults.set_num_sink_tokens(std::numeric_limits<int64_t>::max());
  defaults.set_evict_outside_window(true);
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32, "", defaults);
  uint64_t seed = 400;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> query;
    v1::StepRequest request;
    *request.add_steps() = MakeStep(model, 0, 20, 1, seed += 3, &query);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    ASSERT_NO_FATAL_FAILURE(
        CheckOutput(model, 0, query, 1, response.results(0)));
  }
}

// A failed step's length is what its layer holds, however it failed (but for
// NOT_FOUND), so that a client retrying learns whether its first attempt
// landed; a step whose query would see freed keys appends nothing.
TEST_F(SessionsTest, AFailedStepSaysWhatItsLayerHolds) {
  v1::SessionDefaults defaults;
  defaults.set_window_left(2);
  defaults.set_evict_outside_window(true);
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32, "", defaults);
  v1::StepRequest prefill;
  *prefill.add_steps() = MakeStep(model, 0, 40, 0, 500);
  v1::StepResponse prefilled;
  ASSERT_TRUE(Step(prefill, &prefilled).ok());
  ASSERT_FALSE(prefilled.results(0).has_error());
  v1::StepRequest request;
  v1::SessionStep* wrong_dim = request.add_steps();
  wrong_dim->set_session_id(model.id);
  wrong_dim->set_expected_length(40);
  *wrong_dim->mutable_query() =
      MakeFloat32Tensor({2, 1, 16}, RandomValues(32, 501));
  v1::SessionStep* bool_output = request.add_steps();
  *bool_output = MakeStep(model, 0, 0, 1, 502);
  bool_output->mutable_options()->set_output_dtype(v1::BOOL);
  // One token, and 12 query rows reaching back past the window kept.
  *request.add_steps() = MakeStep(model, 0, 1, 12, 503);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  ASSERT_EQ(response.results_size(), 3);
  EXPECT_EQ(response.results(0).error().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(response.results(0).error().message(),
              ::testing::StartsWith("steps[0].query.shape[2] (Dk) is 16"));
  EXPECT_EQ(response.results(0).length(), 40);
  EXPECT_EQ(response.results(1).error().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(response.results(1).length(), 40);
  EXPECT_EQ(response.results(2).error().code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(response.results(2).error().message(), HasSubstr("freed keys"));
  EXPECT_THAT(response.results(2).error().message(),
              HasSubstr("; nothing was appended or computed"));
  EXPECT_EQ(response.results(2).length(), 40);  // Refused before its append.
}

// RoPE by the session: keys rotated at the positions they take, query rows at
// L − Tq + i, against the reference over rows this test rotates itself
// (GPT-NeoX pairs, half the head).
TEST_F(SessionsTest, RopeSessionsRotateKeysAndQueriesAtTheirPositions) {
  v1::SessionDefaults defaults;
  defaults.mutable_rope()->set_theta(100.0f);
  defaults.mutable_rope()->set_rotary_dim(4);
  SessionModel model = NewSession(1, 4, 2, 8, v1::FLOAT32, "", defaults);
  ASSERT_TRUE(model.defaults.has_rope());
  EXPECT_EQ(model.defaults.rope().rotary_dim(), 4);
  // [rows, 8] rows from `first` on, pairs (m, m + 2) of the first 4 features.
  const auto rotate = [](std::vector<float> x, int64_t rows, int64_t first) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t m = 0; m < 2; ++m) {
        const double angle =
            static_cast<double>(first + r) / std::pow(100.0, m / 2.0);
        float& a = x[r * 8 + m];
        float& b = x[r * 8 + m + 2];
        const double a0 = a, b0 = b;
        a = static_cast<float>(a0 * std::cos(angle) - b0 * std::sin(angle));
        b = static_cast<float>(a0 * std::sin(angle) + b0 * std::cos(angle));
      }
    }
    return x;
  };
  uint64_t seed = 500;
  for (const auto& [tokens, query_len] :
       std::vector<std::pair<int64_t, int64_t>>{
           {10, 0}, {3, 2}, {1, 1}, {1, 1}, {0, 3}, {6, 6}}) {
    std::vector<float> query;
    v1::StepRequest request;
    *request.add_steps() =
        MakeStep(model, 0, tokens, query_len, seed += 3, &query);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    ASSERT_FALSE(response.results(0).has_error())
        << response.results(0).error().message();
    if (query_len == 0) continue;
    const LayerModel& l = model.layers[0];
    std::vector<float> keys, rotated_query;
    for (size_t h = 0; h < l.keys.size(); ++h) {
      const std::vector<float> head = rotate(l.keys[h], l.length, 0);
      keys.insert(keys.end(), head.begin(), head.end());
    }
    std::vector<float> values;
    for (const auto& head : l.values) {
      values.insert(values.end(), head.begin(), head.end());
    }
    for (int64_t h = 0; h < 4; ++h) {
      const std::vector<float> head =
          rotate(std::vector<float>(query.begin() + h * query_len * 8,
                                    query.begin() + (h + 1) * query_len * 8),
                 query_len, l.length - query_len);
      rotated_query.insert(rotated_query.end(), head.begin(), head.end());
    }
    const auto expected =
        ReferenceAttention({1, 4, 2, query_len, l.length, 8, 8}, rotated_query,
                           keys, values, StepReferenceOptions(model));
    ExpectNear("output", *FloatValues(response.results(0).output()),
               expected.output, testing::kOutputF32);
  }
  // A bad RoPE is refused naming its field.
  v1::CreateSessionRequest bad = SmallSession();
  bad.mutable_defaults()->mutable_rope()->set_rotary_dim(3);
  v1::CreateSessionResponse created;
  const grpc::Status status = Create(bad, &created);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("defaults.rope.rotary_dim is 3, expected 0"));
}

TEST_F(SessionsTest, ARetriedStepIsRefusedAndAppendsNothing) {
  SessionModel model = NewSession(1, 4, 4, 8, v1::FLOAT32);
  v1::StepRequest request;
  *request.add_steps() = MakeStep(model, 0, 3, 1, 7);
  v1::StepResponse first, retried;
  ASSERT_TRUE(Step(request, &first).ok());
  ASSERT_FALSE(first.results(0).has_error());
  ASSERT_TRUE(Step(request, &retried).ok());
  ASSERT_TRUE(retried.results(0).has_error());
  EXPECT_EQ(retried.results(0).error().code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(retried.results(0).error().message(),
              HasSubstr("layer 0 holds 3 tokens, the step expected 0; nothing "
                        "was appended"));
  EXPECT_EQ(retried.results(0).length(), 3);  // The first attempt landed.
  v1::GetSessionRequest get;
  get.set_session_id(model.id);
  v1::GetSessionResponse got;
  ASSERT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
  EXPECT_EQ(got.session().lengths(0), 3);
}

// A Step whose attention runs past the call's deadline stops (the paged
// kernel polls every 1,024 keys), fails as a whole and frees the executor;
// its session serves the next step.
TEST_F(SessionsTest, AStepPastItsDeadlineStopsItsCompute) {
  ServerOptions options = Options();
  options.transport.max_message_bytes = 16 << 20;
  options.memory.kv_cache_bytes = 256 << 20;
  options.sessions.page_tokens = 64;
  Start(options);
  // 131,072 tokens of (Hkv 1, D 64) f32, prefilled in chunks of 16,384.
  const int64_t chunk = 16384, chunks = 8, dim = 64, heads = 8;
  SessionModel model = NewSession(1, heads, 1, dim, v1::FLOAT32);
  for (int64_t c = 0; c < chunks; ++c) {
    v1::StepRequest prefill;
    v1::SessionStep* step = prefill.add_steps();
    step->set_session_id(model.id);
    step->set_expected_length(c * chunk);
    *step->mutable_key() = MakeFloat32Tensor(
        {1, chunk, dim}, RandomValues(chunk * dim, static_cast<uint64_t>(c)));
    *step->mutable_value() = MakeFloat32Tensor(
        {1, chunk, dim}, RandomValues(chunk * dim, static_cast<uint64_t>(c)));
    v1::StepResponse response;
    ASSERT_TRUE(Step(prefill, &response).ok());
    ASSERT_FALSE(response.results(0).has_error())
        << response.results(0).error().message();
  }
  // 4,096 query rows of 8 heads over all of it: 1.1 TFLOP, many seconds on
  // any CPU, asked with a 2 s deadline.
  const int64_t length = chunk * chunks, query_len = 4096;
  v1::StepRequest slow;
  v1::SessionStep* step = slow.add_steps();
  step->set_session_id(model.id);
  step->set_expected_length(length);
  *step->mutable_query() = MakeFloat32Tensor(
      {heads, query_len, dim}, RandomValues(heads * query_len * dim, 99));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(2));
  v1::StepResponse slow_response;
  const grpc::Status expired = stub_->Step(&context, slow, &slow_response);
  EXPECT_EQ(expired.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  const absl::Time expired_at = absl::Now();
  // The next step of the session is answered once the compute has stopped.
  v1::StepRequest decode;
  step = decode.add_steps();
  step->set_session_id(model.id);
  step->set_expected_length(length);
  *step->mutable_query() =
      MakeFloat32Tensor({heads, 1, dim}, RandomValues(heads * dim, 98));
  v1::StepResponse decoded;
  ASSERT_TRUE(Step(decode, &decoded).ok());
  ASSERT_FALSE(decoded.results(0).has_error());
  EXPECT_EQ(decoded.results(0).length(), length);
  EXPECT_LT(absl::Now() - expired_at, absl::Seconds(5));
  const std::string deadline =
      R"(attnserve_computes_stopped_total{reason="deadline",rpc="Step"})";
  const std::string cancelled =
      R"(attnserve_computes_stopped_total{reason="cancelled",rpc="Step"})";
  const absl::Time by = absl::Now() + absl::Seconds(30);
  while (Metrics()[deadline] + Metrics()[cancelled] < 1 && absl::Now() < by) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Metrics()[deadline] + Metrics()[cancelled], 1);
}

TEST_F(SessionsTest, AFailedStepFailsOnlyItsOwnResult) {
  SessionModel a = NewSession(1, 4, 2, 8, v1::FLOAT32);
  SessionModel b = NewSession(1, 4, 2, 8, v1::BFLOAT16);
  v1::StepRequest request;
  std::vector<float> query_a, query_b;
  *request.add_steps() = MakeStep(a, 0, 4, 2, 1, &query_a);
  v1::SessionStep* bad = request.add_steps();
  *bad = MakeStep(b, 0, 2, 0, 2);
  bad->mutable_key()->set_dtype(v1::BOOL);  // Malformed.
  v1::SessionStep* unknown = request.add_steps();
  unknown->set_session_id(std::string(32, 'a'));
  v1::SessionStep* wrong = request.add_steps();
  wrong->set_session_id(b.id);
  wrong->set_expected_length(0);
  *wrong->mutable_query() = MakeFloat32Tensor({4, 1, 16}, RandomValues(64, 3));
  // An id over the 64 bytes a message quotes, cut there mid-character: the
  // message must stay UTF-8, or the whole response would not serialise.
  v1::SessionStep* long_id = request.add_steps();
  long_id->set_session_id(std::string(63, 'a') + "\u00e9\u00e9\u00e9");
  // Well formed, but expecting a length b does not have: it fails when it
  // runs, and computes nothing.
  v1::SessionStep* stale = request.add_steps();
  stale->set_session_id(b.id);
  stale->set_expected_length(7);
  *stale->mutable_query() = MakeFloat32Tensor({4, 1, 8}, RandomValues(32, 4));
  const std::string flops =
      R"(attnserve_floating_point_operations_total{rpc="Step"})";
  const double flops_before = Metrics()[flops];
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  ASSERT_EQ(response.results_size(), 6);
  ASSERT_NO_FATAL_FAILURE(CheckOutput(a, 0, query_a, 2, response.results(0)));
  EXPECT_EQ(response.results(1).error().code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(response.results(1).error().message(), HasSubstr("steps[1].key"));
  EXPECT_EQ(response.results(2).error().code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(response.results(2).error().message(),
              HasSubstr("steps[2]: session aaaa"));
  EXPECT_THAT(response.results(3).error().message(),
              HasSubstr("steps[3].query.shape[2] (Dk) is 16, expected 8 (the "
                        "session's key_dim)"));
  EXPECT_THAT(response.results(4).error().message(),
              HasSubstr("steps[4].session_id is \"" + std::string(63, 'a') +
                        "\u00e9\u00e9\u00e9\", expected 32 lowercase hex"));
  EXPECT_EQ(response.results(5).error().code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // Only step 0 computed: H 4, its 2 query rows at the bottom right of 4 keys
  // see 3 and 4 of them, Dk + Dv = 16.
  EXPECT_EQ(Metrics()[flops] - flops_before, 2.0 * 4 * (3 + 4) * 16);
}

TEST_F(SessionsTest, NotFoundSaysWhySoTheClientPrefillsAgain) {
  v1::GetSessionRequest get;
  v1::GetSessionResponse got;
  get.set_session_id(std::string(32, '0'));
  grpc::Status status = stub_->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(),
              HasSubstr("is unknown: never created on this server"));
  EXPECT_THAT(status.error_message(), HasSubstr("prefill it"));

  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32);
  v1::DeleteSessionRequest del;
  del.set_session_id(model.id);
  v1::DeleteSessionResponse deleted;
  ASSERT_TRUE(stub_->DeleteSession(Context().get(), del, &deleted).ok());
  EXPECT_EQ(deleted.deleted().session_id(), model.id);
  get.set_session_id(model.id);
  status = stub_->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("was deleted"));

  v1::CreateSessionRequest create = SmallSession();
  create.set_ttl_seconds(1);
  v1::CreateSessionResponse created;
  ASSERT_TRUE(Create(create, &created).ok());
  EXPECT_EQ(created.session().ttl_seconds(), 1);
  absl::SleepFor(absl::Milliseconds(2200));
  get.set_session_id(created.session().session_id());
  status = stub_->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(
      status.error_message(),
      HasSubstr("expired after 1 s without a step, fork or truncation"));
  EXPECT_EQ(Metrics()["attnserve_session_removals_total{reason=\"expired\"}"],
            1);
}

TEST_F(SessionsTest, ARestartedServerKnowsNoOldSession) {
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32);
  server_->Shutdown();
  server_.reset();
  Start(Options());
  v1::GetSessionRequest get;
  get.set_session_id(model.id);
  v1::GetSessionResponse got;
  const grpc::Status status = stub_->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("is unknown"));
}

// Sessions die with their process: every answer that describes one names
// the replica and its incarnation, and a step sent with the incarnation of a
// process that restarted is refused as a whole, saying so.
TEST_F(SessionsTest, SessionsNameTheirReplicaAndARestartIsTold) {
  ServerOptions options = Options();
  options.sessions.replica_name = "replica-a";
  server_->Shutdown();
  Start(options);
  v1::CreateSessionRequest create = SmallSession();
  v1::CreateSessionResponse created;
  ASSERT_TRUE(Create(create, &created).ok());
  EXPECT_EQ(created.replica().name(), "replica-a");
  const std::string incarnation = created.replica().incarnation();
  ASSERT_EQ(incarnation.size(), 16u);
  EXPECT_EQ(incarnation.find_first_not_of("0123456789abcdef"),
            std::string::npos);
  v1::GetSessionRequest get;
  get.set_session_id(created.session().session_id());
  v1::GetSessionResponse got;
  ASSERT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
  EXPECT_EQ(got.replica().incarnation(), incarnation);
  v1::ForkSessionRequest fork;
  fork.set_session_id(created.session().session_id());
  v1::ForkSessionResponse forked;
  ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
  EXPECT_EQ(forked.replica().incarnation(), incarnation);

  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32);
  v1::StepRequest step;
  *step.add_steps() = MakeStep(model, 0, 2, 1, 3);
  step.set_replica_incarnation(incarnation);
  v1::StepResponse answered;
  ASSERT_TRUE(Step(step, &answered).ok());
  ASSERT_FALSE(answered.results(0).has_error());

  // The same name and address, another process.
  server_->Shutdown();
  server_.reset();
  Start(options);
  v1::CreateSessionResponse again;
  ASSERT_TRUE(Create(create, &again).ok());
  EXPECT_EQ(again.replica().name(), "replica-a");
  EXPECT_NE(again.replica().incarnation(), incarnation);
  *step.mutable_steps(0) = MakeStep(model, 0, 1, 1, 5);
  v1::StepResponse refused;
  const grpc::Status status = Step(step, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(),
              HasSubstr(absl::StrCat("replica_incarnation is \"", incarnation,
                                     "\", but this is replica replica-a "
                                     "incarnation ",
                                     again.replica().incarnation())));
  // A hostile incarnation is quoted cut short.
  step.set_replica_incarnation(std::string(1 << 20, 'x'));
  const grpc::Status long_one = Step(step, &refused);
  EXPECT_EQ(long_one.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(long_one.error_message(), HasSubstr("(1048576 bytes)"));
  EXPECT_LT(long_one.error_message().size(), 700u);
}

// A session id can come back after a restart (the caller chooses it, and the
// removed ids' list died with the process): a stale handle carrying the old
// incarnation must not fork, truncate, delete or look up the new session.
TEST_F(SessionsTest,
       AStaleHandleNeverReachesASessionThatTookItsIdAfterARestart) {
  ServerOptions options = Options();
  options.sessions.replica_name = "replica-b";
  server_->Shutdown();
  Start(options);
  const std::string id = "00112233445566778899aabbccddeeff";
  v1::CreateSessionRequest create = SmallSession();
  create.set_session_id(id);
  v1::CreateSessionResponse first;
  ASSERT_TRUE(Create(create, &first).ok());
  const std::string old_incarnation = first.replica().incarnation();

  server_->Shutdown();
  server_.reset();
  Start(options);
  v1::CreateSessionResponse second;
  ASSERT_TRUE(Create(create, &second).ok());
  const std::string incarnation = second.replica().incarnation();
  ASSERT_NE(incarnation, old_incarnation);
  // The new session holds tokens; the answer names the process.
  v1::StepRequest append;
  v1::SessionStep* step = append.add_steps();
  step->set_session_id(id);
  *step->mutable_key() = MakeFloat32Tensor({2, 3, 8}, RandomValues(48, 1));
  *step->mutable_value() = MakeFloat32Tensor({2, 3, 8}, RandomValues(48, 2));
  v1::StepResponse appended;
  ASSERT_TRUE(Step(append, &appended).ok());
  ASSERT_FALSE(appended.results(0).has_error());
  EXPECT_EQ(appended.replica().name(), "replica-b");
  EXPECT_EQ(appended.replica().incarnation(), incarnation);

  const std::string refusal =
      absl::StrCat("replica_incarnation is \"", old_incarnation,
                   "\", but this is replica replica-b incarnation ",
                   incarnation, ": the session is another process's");
  v1::TruncateSessionRequest truncate;
  truncate.set_session_id(id);
  truncate.set_replica_incarnation(old_incarnation);
  v1::TruncateSessionResponse truncated;
  grpc::Status status =
      stub_->TruncateSession(Context().get(), truncate, &truncated);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr(refusal));
  v1::ForkSessionRequest fork;
  fork.set_session_id(id);
  fork.set_replica_incarnation(old_incarnation);
  v1::ForkSessionResponse forked;
  status = stub_->ForkSession(Context().get(), fork, &forked);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr(refusal));
  v1::DeleteSessionRequest del;
  del.set_session_id(id);
  del.set_replica_incarnation(old_incarnation);
  v1::DeleteSessionResponse deleted;
  status = stub_->DeleteSession(Context().get(), del, &deleted);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr(refusal));
  v1::GetSessionRequest get;
  get.set_session_id(id);
  get.set_replica_incarnation(old_incarnation);
  v1::GetSessionResponse got;
  status = stub_->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr(refusal));

  // Untouched: still 3 tokens, no child; its own incarnation reaches it.
  get.set_replica_incarnation(incarnation);
  ASSERT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
  ASSERT_EQ(got.session().lengths_size(), 1);
  EXPECT_EQ(got.session().lengths(0), 3);
  v1::ListSessionsResponse listed;
  ASSERT_TRUE(
      stub_->ListSessions(Context().get(), v1::ListSessionsRequest(), &listed)
          .ok());
  EXPECT_EQ(listed.sessions_size(), 1);
  truncate.set_replica_incarnation(incarnation);
  truncate.set_length(1);
  ASSERT_TRUE(
      stub_->TruncateSession(Context().get(), truncate, &truncated).ok());
  EXPECT_EQ(truncated.session().lengths(0), 1);
  fork.set_replica_incarnation(incarnation);
  ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
  del.set_replica_incarnation(incarnation);
  ASSERT_TRUE(stub_->DeleteSession(Context().get(), del, &deleted).ok());
  // Empty: not checked.
  del.set_session_id(forked.session().session_id());
  del.clear_replica_incarnation();
  EXPECT_TRUE(stub_->DeleteSession(Context().get(), del, &deleted).ok());
}

// A caller may choose the id (to place the session by its hash before it
// knows the replica): it must look random, and be new.
TEST_F(SessionsTest, ACallerChosenSessionIdIsUsedOnceAndChecked) {
  const std::string id = "0123456789abcdef0123456789abcdef";
  v1::CreateSessionRequest create = SmallSession();
  create.set_session_id(id);
  v1::CreateSessionResponse created;
  ASSERT_TRUE(Create(create, &created).ok());
  EXPECT_EQ(created.session().session_id(), id);
  grpc::Status status = Create(create, &created);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(status.error_message(),
              HasSubstr("session_id " + id + " is taken on replica"));
  // Deleted, its id is still not reused while its tombstone stands.
  v1::DeleteSessionRequest remove;
  remove.set_session_id(id);
  v1::DeleteSessionResponse removed;
  ASSERT_TRUE(stub_->DeleteSession(Context().get(), remove, &removed).ok());
  status = Create(create, &created);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  for (const std::string& bad :
       std::vector<std::string>{"0123", "0123456789ABCDEF0123456789ABCDEF",
                                std::string(100000, 'a')}) {
    create.set_session_id(bad);
    status = Create(create, &created);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("session_id is "));
    EXPECT_THAT(status.error_message(),
                HasSubstr("expected empty (the server draws one) or 32 "
                          "lowercase hex digits"));
    EXPECT_LT(status.error_message().size(), 600u);
  }
}

// A draining server takes no new sessions but serves the steps of those it
// holds through its grace period.
TEST_F(SessionsTest, ADrainRefusesNewSessionsAndServesSteps) {
  ServerOptions options = Options();
  options.drain_grace = absl::Seconds(3);
  server_->Shutdown();
  Start(options);
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32);
  std::thread drain([this] { server_->Shutdown(); });
  // The drain has begun once health says so.
  auto health = grpc::health::v1::Health::NewStub(channel_);
  for (int i = 0; i < 200; ++i) {
    grpc::health::v1::HealthCheckRequest ask;
    grpc::health::v1::HealthCheckResponse said;
    if (health->Check(Context().get(), ask, &said).ok() &&
        said.status() == grpc::health::v1::HealthCheckResponse::NOT_SERVING) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  v1::CreateSessionRequest create = SmallSession();
  v1::CreateSessionResponse created;
  const grpc::Status refused = Create(create, &created);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(refused.error_message(),
              HasSubstr("is draining: it serves the sessions it holds but "
                        "takes no new ones"));
  v1::ForkSessionRequest fork;
  fork.set_session_id(model.id);
  v1::ForkSessionResponse forked;
  EXPECT_EQ(stub_->ForkSession(Context().get(), fork, &forked).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  std::vector<float> query;
  v1::StepRequest step;
  *step.add_steps() = MakeStep(model, 0, 3, 1, 11, &query);
  v1::StepResponse answered;
  ASSERT_TRUE(Step(step, &answered).ok());
  CheckOutput(model, 0, query, 1, answered.results(0));
  drain.join();
}

TEST_F(SessionsTest, ForksSharePagesAndCopyOnlyTheLastOnWrite) {
  SessionModel parent = NewSession(1, 4, 2, 16, v1::BFLOAT16);
  for (int chunk = 0; chunk < 4; ++chunk) {  // 4 x 100 = 400 tokens.
    v1::StepRequest request;
    *request.add_steps() = MakeStep(parent, 0, 100, 0, 10 + chunk);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    ASSERT_FALSE(response.results(0).has_error());
  }
  const double one_copy = Metrics()["attnserve_kv_cache_bytes"];
  // 400 tokens: 25 pages of 16 tokens x 2 heads x 32 x 2 bytes, each 2 KiB
  // charged as a whole 4 KiB page.
  EXPECT_EQ(one_copy, 25 * 4096);
  std::vector<SessionModel> children;
  for (int i = 0; i < 64; ++i) {
    v1::ForkSessionRequest fork;
    fork.set_session_id(parent.id);
    v1::ForkSessionResponse forked;
    ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
    SessionModel child = parent;
    child.id = forked.session().session_id();
    children.push_back(child);
  }
  std::map<std::string, double> metrics = Metrics();
  EXPECT_EQ(metrics["attnserve_kv_cache_bytes"], one_copy);
  EXPECT_EQ(metrics["attnserve_kv_cache_shared_bytes"], one_copy);
  EXPECT_EQ(metrics["attnserve_sessions"], 65);
  // Each child decodes one token of its own: 400 % 16 == 0, so one new page
  // each, and nothing copied.
  for (int i = 0; i < 64; ++i) {
    std::vector<float> query;
    v1::StepRequest request;
    *request.add_steps() =
        MakeStep(children[static_cast<size_t>(i)], 0, 1, 1, 500 + i, &query);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    if (i % 16 == 0) {
      ASSERT_NO_FATAL_FAILURE(CheckOutput(children[static_cast<size_t>(i)], 0,
                                          query, 1, response.results(0)));
    }
  }
  const double page = 4096;
  metrics = Metrics();
  EXPECT_EQ(metrics["attnserve_kv_cache_bytes"], one_copy + 64 * page);
  EXPECT_LE(metrics["attnserve_kv_cache_bytes"], 1.1 * one_copy + 64 * page);
  // A fork at a page's middle copies only its partial last page when written.
  v1::ForkSessionRequest fork;
  fork.set_session_id(parent.id);
  fork.set_length(390);
  v1::ForkSessionResponse forked;
  ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
  SessionModel mid = parent;
  mid.id = forked.session().session_id();
  Truncate(mid, 390);
  std::vector<float> query;
  v1::StepRequest request;
  *request.add_steps() = MakeStep(mid, 0, 2, 2, 900, &query);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  ASSERT_NO_FATAL_FAILURE(CheckOutput(mid, 0, query, 2, response.results(0)));
  EXPECT_EQ(Metrics()["attnserve_kv_cache_bytes"], one_copy + 65 * page);
  // The parent's own tokens are untouched by the fork's write.
  std::vector<float> parent_query;
  v1::StepRequest parent_request;
  *parent_request.add_steps() = MakeStep(parent, 0, 0, 3, 901, &parent_query);
  ASSERT_TRUE(Step(parent_request, &response).ok());
  ASSERT_NO_FATAL_FAILURE(
      CheckOutput(parent, 0, parent_query, 3, response.results(0)));
}

TEST_F(SessionsTest, CallerLimitsAndMalformedRequests) {
  v1::CreateSessionRequest create;
  v1::CreateSessionResponse created;
  create.set_num_layers(0);
  grpc::Status status = Create(create, &created);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("num_layers is 0, expected 1 to 256"));
  create.set_num_layers(1);
  create.set_num_heads(6);
  create.set_num_kv_heads(4);
  status = Create(create, &created);
  EXPECT_THAT(
      status.error_message(),
      HasSubstr("num_kv_heads is 4, expected a divisor of num_heads 6"));
  create.set_num_kv_heads(2);
  create.set_key_dim(8);
  status = Create(create, &created);
  EXPECT_THAT(status.error_message(), HasSubstr("dtype is DTYPE_UNSPECIFIED"));
  create.set_dtype(v1::FLOAT32);
  create.set_max_tokens(1 << 30);
  status = Create(create, &created);
  EXPECT_THAT(status.error_message(), HasSubstr("max_tokens is 1073741824"));
  create.set_max_tokens(0);
  create.set_key_dim(4000);
  create.set_num_kv_heads(6);
  status = Create(create, &created);  // A page of 16 x 6 x 8000 x 4 = 3 MiB.
  EXPECT_TRUE(status.ok()) << status.error_message();
  create.set_num_heads(600);
  create.set_num_kv_heads(600);
  status = Create(create, &created);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("over the page limit"));

  // The attention variant of the defaults.
  v1::CreateSessionRequest variant = SmallSession();
  const auto refused = [&](const std::function<void(v1::SessionDefaults&)>& set,
                           const std::string& message) {
    v1::CreateSessionRequest bad = variant;
    set(*bad.mutable_defaults());
    const grpc::Status refusal = Create(bad, &created);
    EXPECT_EQ(refusal.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(refusal.error_message(), HasSubstr(message));
  };
  refused([](v1::SessionDefaults& d) { d.set_window_left(-5); },
          "defaults.window_left is -5, expected -1 or absent");
  refused([](v1::SessionDefaults& d) { d.set_num_sink_tokens(-1); },
          "defaults.num_sink_tokens is -1, expected >= 0");
  refused([](v1::SessionDefaults& d) { d.add_alibi_slopes(0.5f); },
          "defaults.alibi_slopes has 1 slopes, expected 2");
  refused(
      [](v1::SessionDefaults& d) {
        d.add_alibi_slopes(0.5f);
        d.add_alibi_slopes(std::numeric_limits<float>::quiet_NaN());
      },
      "defaults.alibi_slopes[1] is nan");
  refused([](v1::SessionDefaults& d) { d.set_softcap(0.0f); },
          "defaults.softcap is 0, expected a finite number >= 1.17549435e-38");
  refused(
      [](v1::SessionDefaults& d) { d.set_softcap(2e-39f); },
      "expected a finite number >= 1.17549435e-38 (the smallest normal float)");
  refused([](v1::SessionDefaults& d) { d.set_evict_outside_window(true); },
          "defaults.evict_outside_window is true without a window");

  v1::StepRequest empty;
  v1::StepResponse response;
  status = Step(empty, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("steps is empty"));
  v1::StepRequest many;
  for (int i = 0; i < 1025; ++i) many.add_steps();
  status = Step(many, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("over max_steps_per_call 1024"));

  SessionModel model = NewSession(2, 4, 2, 8, v1::FLOAT32);
  v1::StepRequest request;
  v1::SessionStep* step = request.add_steps();
  step->set_session_id(std::string(100000, 'x'));
  step = request.add_steps();
  step->set_session_id(model.id);
  step->set_layer(2);
  step = request.add_steps();
  *step = MakeStep(model, 0, 2, 0, 1);
  step->mutable_value()->clear_shape();
  step = request.add_steps();
  step->set_session_id(model.id);
  step->mutable_options()->set_return_lse(true);
  step = request.add_steps();
  step->set_session_id(model.id);
  step->set_expected_length(-1);
  step = request.add_steps();
  step->set_session_id(model.id);
  step->set_expected_length(std::numeric_limits<int64_t>::max());
  *step->mutable_key() = MakeFloat32Tensor({2, 1, 8}, RandomValues(16, 5));
  *step->mutable_value() = MakeFloat32Tensor({2, 1, 8}, RandomValues(16, 6));
  ASSERT_TRUE(Step(request, &response).ok());
  EXPECT_THAT(response.results(0).error().message(),
              HasSubstr("steps[0].session_id is \"xxxx"));
  EXPECT_LT(response.results(0).error().message().size(), 500u);
  EXPECT_THAT(response.results(1).error().message(),
              HasSubstr("steps[1].layer is 2, expected 0 to 1"));
  EXPECT_THAT(response.results(2).error().message(),
              HasSubstr("steps[2].value"));
  EXPECT_THAT(response.results(3).error().message(),
              HasSubstr("options.return_lse is set but the step has no query"));
  EXPECT_THAT(response.results(4).error().message(),
              HasSubstr("expected_length is -1, expected 0 to the session's "
                        "max_tokens 131072"));
  EXPECT_THAT(response.results(5).error().message(),
              HasSubstr("expected_length is 9223372036854775807"));
  // A query whose output would pass the message limit is refused whole: Dv 64
  // makes a 640 KB query's output 5 MB.
  create.set_num_heads(4);
  create.set_num_kv_heads(4);
  create.set_key_dim(8);
  create.set_value_dim(64);
  ASSERT_TRUE(Create(create, &created).ok());
  v1::StepRequest huge;
  v1::SessionStep* wide = huge.add_steps();
  wide->set_session_id(created.session().session_id());
  *wide->mutable_query() =
      MakeFloat32Tensor({4, 5000, 8}, RandomValues(4 * 5000 * 8, 4));
  status = Step(huge, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("over the message limit of 4194304 bytes"));
}

class SessionBudgetTest : public SessionsTest {
 protected:
  void SetUp() override {}
};

TEST_F(SessionBudgetTest, LeastRecentlyUsedSessionsAreEvictedPastTheBudget) {
  ServerOptions options = Options();
  // Pages of 16 x 2 x 16 x 4 = 2 KiB, each charged as 4 KiB; a budget of 20
  // and room for five sessions' bookkeeping (1024 + 48 + 4 x 16 each).
  options.memory.kv_cache_bytes = 20 * 4096 + 8192;
  Start(options);
  std::vector<SessionModel> models;
  for (int i = 0; i < 6; ++i) {
    models.push_back(NewSession(1, 2, 2, 8, v1::FLOAT32));
    v1::StepRequest request;
    *request.add_steps() = MakeStep(models.back(), 0, 64, 0, i);  // 4 pages.
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    ASSERT_FALSE(response.results(0).has_error())
        << response.results(0).error().message();
    EXPECT_LE(Metrics()["attnserve_kv_cache_bytes"], 20 * 4096);
  }
  // 6 x 4 pages past 20: the first session went.
  v1::GetSessionRequest get;
  get.set_session_id(models[0].id);
  v1::GetSessionResponse got;
  const grpc::Status status = stub_->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(),
              HasSubstr("evicted (least recently used) to make room in the KV "
                        "cache budget of 90112 bytes"));
  get.set_session_id(models[5].id);
  EXPECT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
  EXPECT_EQ(Metrics()["attnserve_session_removals_total{reason=\"evicted\"}"],
            1);
  // A step larger than the whole budget is refused, naming it.
  v1::StepRequest request;
  *request.add_steps() = MakeStep(models[5], 0, 400, 0, 99);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  EXPECT_EQ(response.results(0).error().code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(response.results(0).error().message(),
              HasSubstr("KV cache budget (kv_cache_bytes) of 90112 bytes"));
}

// A fork shares its parent's pages but copies their table: a reference per
// page, charged to the budget with the session's record. Forks of a long
// session past the budget evict the least recently used (the oldest forks),
// never the parent they fork.
TEST_F(SessionBudgetTest, ForksOfALongSessionAreChargedTheirTables) {
  ServerOptions options = Options();
  // Pages of 16 tokens charged 4 KiB each; 60 of them in a budget of 64.
  options.memory.kv_cache_bytes = 64 * 4096;
  Start(options);
  SessionModel parent = NewSession(1, 2, 2, 8, v1::FLOAT32);
  v1::StepRequest prefill;
  *prefill.add_steps() = MakeStep(parent, 0, 960, 0, 7);
  v1::StepResponse prefilled;
  ASSERT_TRUE(Step(prefill, &prefilled).ok());
  ASSERT_FALSE(prefilled.results(0).has_error())
      << prefilled.results(0).error().message();
  // Each fork: 1024 + 48 + 60 x 16 = 2032 bytes; the 16 KiB left hold 8.
  constexpr int kForks = 40;
  for (int i = 0; i < kForks; ++i) {
    v1::ForkSessionRequest fork;
    fork.set_session_id(parent.id);
    v1::ForkSessionResponse forked;
    const grpc::Status status =
        stub_->ForkSession(Context().get(), fork, &forked);
    ASSERT_TRUE(status.ok()) << "fork " << i << ": " << status.error_message();
  }
  std::map<std::string, double> metrics = Metrics();
  EXPECT_GE(metrics["attnserve_session_removals_total{reason=\"evicted\"}"],
            kForks - 8);
  EXPECT_LE(metrics["attnserve_sessions"], 1 + 8);
  EXPECT_LE(metrics["attnserve_kv_cache_bytes"], 64 * 4096);
  // The parent stays, and steps.
  std::vector<float> query;
  v1::StepRequest step;
  *step.add_steps() = MakeStep(parent, 0, 1, 1, 8, &query);
  v1::StepResponse stepped;
  ASSERT_TRUE(Step(step, &stepped).ok());
  EXPECT_FALSE(stepped.results(0).has_error())
      << stepped.results(0).error().message();
}

// A step that would not fit even with every idle session evicted, and a fork
// refused for freed keys, are refused without evicting anyone.
TEST_F(SessionBudgetTest, ARefusedStepOrForkEvictsNothing) {
  ServerOptions options = Options();
  // 4 pages, and a page's worth for the sessions' bookkeeping (1024 + 48
  // + 16 a page each).
  options.memory.kv_cache_bytes = 5 * 4096;
  options.sessions.max_sessions = 2;
  Start(options);
  SessionModel bystander = NewSession(1, 2, 2, 8, v1::FLOAT32);
  SessionModel big = NewSession(1, 2, 2, 8, v1::FLOAT32);
  for (auto [model, tokens] : {std::pair{&bystander, 16}, {&big, 48}}) {
    v1::StepRequest request;
    *request.add_steps() = MakeStep(*model, 0, tokens, 0, 600 + tokens);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    ASSERT_FALSE(response.results(0).has_error())
        << response.results(0).error().message();
  }
  const auto alive = [&](const std::string& id) {
    v1::GetSessionRequest get;
    get.set_session_id(id);
    v1::GetSessionResponse got;
    return stub_->GetSession(Context().get(), get, &got).ok();
  };
  // 2 more pages: with the bystander gone (its page and 1088 bytes of
  // bookkeeping), `big` alone would hold 5 pages and its bookkeeping.
  v1::StepRequest request;
  *request.add_steps() = MakeStep(big, 0, 32, 0, 700);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  EXPECT_EQ(response.results(0).error().code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(response.results(0).error().message(),
              HasSubstr("(this caller holds 18592 bytes; the step "
                        "needs 8224 more), and evicting every session that "
                        "may go for this caller would not make room"));
  EXPECT_EQ(response.results(0).length(), 48);
  EXPECT_TRUE(alive(bystander.id));

  // At max_sessions, a fork would evict the least recently used session, the
  // bystander; refused for the keys it would need, it evicts none.
  v1::DeleteSessionRequest remove;
  remove.set_session_id(big.id);
  v1::DeleteSessionResponse removed;
  ASSERT_TRUE(stub_->DeleteSession(Context().get(), remove, &removed).ok());
  v1::SessionDefaults defaults;
  defaults.set_window_left(2);
  defaults.set_evict_outside_window(true);
  SessionModel windowed = NewSession(1, 2, 2, 8, v1::FLOAT32, "", defaults);
  request.Clear();
  *request.add_steps() = MakeStep(windowed, 0, 40, 0, 701);
  ASSERT_TRUE(Step(request, &response).ok());
  ASSERT_FALSE(response.results(0).has_error());
  v1::ForkSessionRequest fork;
  fork.set_session_id(windowed.id);
  fork.set_length(10);
  v1::ForkSessionResponse forked;
  const grpc::Status status =
      stub_->ForkSession(Context().get(), fork, &forked);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("freed keys"));
  EXPECT_TRUE(alive(bystander.id));
  EXPECT_EQ(Metrics()["attnserve_session_removals_total{reason=\"evicted\"}"],
            0);
}

// A step's key, value and query count against --max_elements as an Attend's
// tensors do.
TEST_F(SessionBudgetTest, StepTensorsAreBoundByMaxElements) {
  ServerOptions options = Options();
  options.limits.max_elements = 100;
  Start(options);
  SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32);
  for (auto [tokens, query_len, field] :
       {std::tuple{8, 0, "key"}, {1, 8, "query"}}) {
    v1::StepRequest request;
    *request.add_steps() = MakeStep(model, 0, tokens, query_len, 800);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    EXPECT_EQ(response.results(0).error().code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(response.results(0).error().message(),
                HasSubstr(absl::StrCat("steps[0].", field,
                                       " has 128 elements, over the "
                                       "max_elements limit of 100")));
    Truncate(model, 0);
  }
  // And its output [H, Tq, Dv], named by the query's Tq: with Dv 32, three
  // query rows of 2 x 8 make 2 x 3 x 32.
  v1::CreateSessionRequest create = SmallSession();
  create.set_num_kv_heads(1);
  create.set_value_dim(32);
  v1::CreateSessionResponse created;
  ASSERT_TRUE(Create(create, &created).ok());
  v1::StepRequest request;
  v1::SessionStep* step = request.add_steps();
  step->set_session_id(created.session().session_id());
  *step->mutable_key() = MakeFloat32Tensor({1, 3, 8}, RandomValues(24, 901));
  *step->mutable_value() = MakeFloat32Tensor({1, 3, 32}, RandomValues(96, 902));
  *step->mutable_query() = MakeFloat32Tensor({2, 3, 8}, RandomValues(48, 903));
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  EXPECT_EQ(response.results(0).error().code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(response.results(0).error().message(),
              HasSubstr("steps[0].query.shape[1] (Tq) is 3: the output [H, Tq, "
                        "Dv] = [2, 3, 32] would hold 192 elements, over the "
                        "max_elements limit of 100"));
}

// An answer built without a compute (a ListSessions page) is held, as the
// message and on the wire, until its client reads it: it is charged to the
// in-flight budget like a compute's memory, or unread pages of many calls
// would hold memory the budget does not see.
TEST_F(SessionBudgetTest, AListSessionsAnswerIsChargedToTheInflightBudget) {
  ServerOptions options = Options();
  // Calls get 6 MiB of it, one connection half: 3 MiB.
  options.memory.max_inflight_bytes = 8 << 20;
  Start(options);
  // Each described with 4,096 ALiBi slopes: over 16 KB; 150 of them 2.4 MB.
  v1::SessionDefaults defaults;
  for (int h = 0; h < 4096; ++h) defaults.add_alibi_slopes(0.5f);
  for (int i = 0; i < 150; ++i) {
    NewSession(1, 4096, 1, 1, v1::FLOAT32, "", defaults);
  }
  v1::ListSessionsRequest list;
  v1::ListSessionsResponse page;
  grpc::Status status = stub_->ListSessions(Context().get(), list, &page);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("max_inflight_bytes"));
  list.set_page_size(20);
  status = stub_->ListSessions(Context().get(), list, &page);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(page.sessions_size(), 20);
}

// ListSessions answers a page at a time, as many sessions as fit in a
// message (or page_size), oldest first; the client library and the tokens
// walk them all. total_bytes counts a page forks share once.
TEST_F(SessionBudgetTest, ListSessionsPagesWhatDoesNotFitInAMessage) {
  ServerOptions options = Options();
  options.transport.max_message_bytes = 20000;
  Start(options);
  // Each described with 1,024 ALiBi slopes: over 4 KB.
  v1::SessionDefaults defaults;
  for (int h = 0; h < 1024; ++h) defaults.add_alibi_slopes(0.5f);
  std::vector<std::string> ids;
  for (int i = 0; i < 10; ++i) {
    ids.push_back(NewSession(1, 1024, 1, 8, v1::FLOAT32, "", defaults).id);
  }
  SessionModel small = NewSession(1, 2, 2, 8, v1::FLOAT32);
  ids.push_back(small.id);
  v1::StepRequest request;
  *request.add_steps() = MakeStep(small, 0, 40, 0, 900);  // 3 pages.
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response).ok());
  v1::ForkSessionRequest fork;
  fork.set_session_id(small.id);
  v1::ForkSessionResponse forked;
  ASSERT_TRUE(stub_->ForkSession(Context().get(), fork, &forked).ok());
  ids.push_back(forked.session().session_id());

  for (const int64_t page_size : {0, 5}) {
    SCOPED_TRACE(absl::StrCat("page_size ", page_size));
    v1::ListSessionsRequest list;
    list.set_page_size(page_size);
    std::vector<std::string> listed;
    int pages = 0;
    for (; pages < 20; ++pages) {
      v1::ListSessionsResponse page;
      const grpc::Status status =
          stub_->ListSessions(Context().get(), list, &page);
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_LT(page.ByteSizeLong(), 20000u);
      if (page_size > 0) {
        EXPECT_LE(page.sessions_size(), page_size);
      }
      EXPECT_EQ(page.total_bytes(), 3 * 4096);  // Shared pages once.
      for (const v1::SessionInfo& info : page.sessions()) {
        listed.push_back(info.session_id());
      }
      if (page.next_page_token().empty()) break;
      list.set_page_token(page.next_page_token());
    }
    EXPECT_GT(pages, 1);
    EXPECT_EQ(listed, ids);
  }

  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(absl::StrCat("127.0.0.1:", server_->port()));
  ASSERT_TRUE(client.ok());
  const absl::StatusOr<v1::ListSessionsResponse> all =
      (*client)->ListSessions(absl::Seconds(30));
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->sessions_size(), static_cast<int>(ids.size()));
  EXPECT_EQ(all->sessions(11).session_id(), ids[11]);

  v1::ListSessionsRequest bad;
  bad.set_page_token("12-not-an-id");
  v1::ListSessionsResponse page;
  grpc::Status status = stub_->ListSessions(Context().get(), bad, &page);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(),
              HasSubstr("expected empty or the next_page_token"));
  bad.Clear();
  bad.set_page_size(-1);
  status = stub_->ListSessions(Context().get(), bad, &page);
  EXPECT_THAT(status.error_message(), HasSubstr("page_size is -1"));
}

TEST_F(SessionBudgetTest, WithoutEvictionPastTheBudgetIsRefused) {
  ServerOptions options = Options();
  options.memory.kv_cache_bytes = 20 * 4096;
  options.sessions.eviction = EvictionPolicy::kNone;
  options.sessions.max_sessions = 3;
  Start(options);
  std::vector<SessionModel> models;
  for (int i = 0; i < 3; ++i) {
    models.push_back(NewSession(1, 2, 2, 8, v1::FLOAT32));
  }
  v1::CreateSessionRequest create = SmallSession();
  v1::CreateSessionResponse created;
  grpc::Status status = Create(create, &created);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("max_sessions 3 sessions and kv_eviction is none"));
  for (int i = 0; i < 3; ++i) {
    v1::StepRequest request;
    *request.add_steps() = MakeStep(models[static_cast<size_t>(i)], 0, 112, 0,
                                    i);  // 7 pages each.
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    if (i < 2) {
      EXPECT_FALSE(response.results(0).has_error());
    } else {
      EXPECT_EQ(response.results(0).error().code(),
                grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_THAT(response.results(0).error().message(),
                  HasSubstr("kv_eviction is none"));
    }
  }
  EXPECT_EQ(Metrics()["attnserve_kv_cache_bytes"], 14 * 4096);
  // Every session still answers: nothing was evicted.
  for (const SessionModel& model : models) {
    v1::GetSessionRequest get;
    get.set_session_id(model.id);
    v1::GetSessionResponse got;
    EXPECT_TRUE(stub_->GetSession(Context().get(), get, &got).ok());
  }
}

TEST_F(SessionBudgetTest, EachTokenOwnsItsSessions) {
  ServerOptions options = Options();
  const std::string tokens = ::testing::TempDir() + "/sessions_tokens";
  std::ofstream(tokens) << "alice-token\n\nbob-token\n";
  options.auth_token_file = tokens;
  Start(options);
  SessionModel alices = NewSession(1, 2, 2, 8, v1::FLOAT32, "alice-token");
  const std::string unknown(32, 'c');
  // Every call on alice's session from bob gets what an unknown id gets.
  const auto message_for = [&](const std::string& id,
                               const std::string& token) {
    std::vector<std::string> messages;
    v1::GetSessionRequest get;
    get.set_session_id(id);
    v1::GetSessionResponse got;
    grpc::Status status = stub_->GetSession(Context(token).get(), get, &got);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    messages.push_back(status.error_message());
    v1::ForkSessionRequest fork;
    fork.set_session_id(id);
    v1::ForkSessionResponse forked;
    status = stub_->ForkSession(Context(token).get(), fork, &forked);
    messages.push_back(status.error_message());
    v1::TruncateSessionRequest truncate;
    truncate.set_session_id(id);
    v1::TruncateSessionResponse truncated;
    status = stub_->TruncateSession(Context(token).get(), truncate, &truncated);
    messages.push_back(status.error_message());
    v1::DeleteSessionRequest del;
    del.set_session_id(id);
    v1::DeleteSessionResponse deleted;
    status = stub_->DeleteSession(Context(token).get(), del, &deleted);
    messages.push_back(status.error_message());
    v1::StepRequest request;
    request.add_steps()->set_session_id(id);
    v1::StepResponse response;
    EXPECT_TRUE(Step(request, &response, token).ok());
    messages.push_back(response.results(0).error().message());
    for (std::string& m : messages) {
      const size_t at = m.find(id);
      if (at != std::string::npos) m.replace(at, id.size(), "ID");
    }
    return messages;
  };
  const std::vector<std::string> from_bob = message_for(alices.id, "bob-token");
  EXPECT_EQ(from_bob, message_for(unknown, "bob-token"));
  for (const std::string& m : from_bob) EXPECT_THAT(m, HasSubstr("is unknown"));
  v1::ListSessionsResponse listed;
  ASSERT_TRUE(stub_
                  ->ListSessions(Context("bob-token").get(),
                                 v1::ListSessionsRequest(), &listed)
                  .ok());
  EXPECT_EQ(listed.sessions_size(), 0);
  ASSERT_TRUE(stub_
                  ->ListSessions(Context("alice-token").get(),
                                 v1::ListSessionsRequest(), &listed)
                  .ok());
  ASSERT_EQ(listed.sessions_size(), 1);
  EXPECT_EQ(listed.sessions(0).session_id(), alices.id);
  // Alice's session is whole after bob's attempts.
  v1::StepRequest request;
  *request.add_steps() = MakeStep(alices, 0, 3, 1, 5);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response, "alice-token").ok());
  EXPECT_FALSE(response.results(0).has_error())
      << response.results(0).error().message();
  // Without a token: refused at the gate.
  v1::GetSessionRequest get;
  get.set_session_id(alices.id);
  v1::GetSessionResponse got;
  EXPECT_EQ(stub_->GetSession(Context().get(), get, &got).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

// Under mutual TLS without tokens, each client certificate's issuer (its name
// and key), subject and subject alternative names own its sessions: a
// certificate of the same subject from another trusted CA is another
// identity, even from a CA of the same name (until 2026-12-07 that one was
// the same), and so is each SPIFFE workload under an empty subject (until
// 2026-12-07 they were all one); a certificate re-issued under the same names
// by the same CA keeps the sessions; and an admin token (weights) changes no
// certificate's identity.
TEST_F(SessionBudgetTest, EachClientCertificateOwnsItsSessions) {
  std::optional<testing::TestCertificates> certs = testing::MakeCertificates();
  ASSERT_TRUE(certs.has_value()) << "openssl could not make certificates";
  ServerOptions options = Options();
  options.tls = {certs->directory + "/server.crt",
                 certs->directory + "/server.key",
                 certs->directory + "/all_cas.crt"};
  const std::string admins = ::testing::TempDir() + "/certificate_admins";
  std::ofstream(admins) << "admin-token\n";
  options.weights_admin_token_file = admins;
  Start(options);
  const auto stub_for = [&](const std::string& cert, const std::string& key) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = certs->ca;
    ssl.pem_cert_chain = cert;
    ssl.pem_private_key = key;
    return v1::AttentionService::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::SslCredentials(ssl)));
  };
  auto client = stub_for(certs->client_cert, certs->client_key);
  auto other = stub_for(certs->other_cert, certs->other_key);
  v1::CreateSessionRequest create = SmallSession();
  v1::CreateSessionResponse created;
  ASSERT_TRUE(
      client->CreateSession(Context("admin-token").get(), create, &created)
          .ok());
  const std::string id = created.session().session_id();
  v1::GetSessionRequest get;
  get.set_session_id(id);
  v1::GetSessionResponse got;
  EXPECT_TRUE(client->GetSession(Context().get(), get, &got).ok());
  grpc::Status status =
      other->GetSession(Context("admin-token").get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  status = other->GetSession(Context().get(), get, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("is unknown"));
  for (const auto& [cert, key] :
       {std::pair{certs->impostor_cert, certs->impostor_key},
        {certs->twin_cert, certs->twin_key}}) {
    status = stub_for(cert, key)->GetSession(Context().get(), get, &got);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(status.error_message(), HasSubstr("is unknown"));
  }
  // Re-issued under the same names by the same CA, its SANs in another order
  // too (until 2026-12-07 that order made another identity).
  for (const auto& [cert, key] :
       {std::pair{certs->reissued_cert, certs->reissued_key},
        {certs->reordered_cert, certs->reordered_key}}) {
    EXPECT_TRUE(
        stub_for(cert, key)->GetSession(Context().get(), get, &got).ok());
  }
  auto workload_a = stub_for(certs->spiffe_a_cert, certs->spiffe_a_key);
  auto workload_b = stub_for(certs->spiffe_b_cert, certs->spiffe_b_key);
  v1::CreateSessionResponse workloads;
  ASSERT_TRUE(
      workload_a->CreateSession(Context().get(), create, &workloads).ok());
  v1::GetSessionRequest get_workloads;
  get_workloads.set_session_id(workloads.session().session_id());
  EXPECT_TRUE(
      workload_a->GetSession(Context().get(), get_workloads, &got).ok());
  EXPECT_EQ(
      workload_b->GetSession(Context().get(), get_workloads, &got).error_code(),
      grpc::StatusCode::NOT_FOUND);
  v1::DeleteSessionRequest del;
  del.set_session_id(id);
  v1::DeleteSessionResponse deleted;
  EXPECT_EQ(other->DeleteSession(Context().get(), del, &deleted).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::ListSessionsResponse listed;
  ASSERT_TRUE(
      other->ListSessions(Context().get(), v1::ListSessionsRequest(), &listed)
          .ok());
  EXPECT_EQ(listed.sessions_size(), 0);
  EXPECT_TRUE(client->DeleteSession(Context().get(), del, &deleted).ok());
  ASSERT_TRUE(
      workload_b
          ->ListSessions(Context().get(), v1::ListSessionsRequest(), &listed)
          .ok());
  EXPECT_EQ(listed.sessions_size(), 0);
}

// A flood of creations and appends far past the budget and max_sessions:
// the pages held never pass the budget, the sessions never pass their limit,
// and every refusal or eviction is reported.
TEST_F(SessionBudgetTest, AFloodStaysWithinTheBudget) {
  ServerOptions options = Options();
  options.memory.kv_cache_bytes = 40 * 4096;
  options.sessions.max_sessions = 16;
  Start(options);
  int evictions_seen = 0;
  for (int i = 0; i < 200; ++i) {
    SessionModel model = NewSession(1, 2, 2, 8, v1::FLOAT32);
    v1::StepRequest request;
    *request.add_steps() = MakeStep(model, 0, 48, 0, i);
    v1::StepResponse response;
    ASSERT_TRUE(Step(request, &response).ok());
    if (response.results(0).has_error()) {
      EXPECT_EQ(response.results(0).error().code(),
                grpc::StatusCode::NOT_FOUND);
    }
    if (i % 20 == 0) {
      std::map<std::string, double> metrics = Metrics();
      EXPECT_LE(metrics["attnserve_kv_cache_bytes"], 40 * 4096);
      EXPECT_LE(metrics["attnserve_sessions"], 16);
      evictions_seen = static_cast<int>(
          metrics["attnserve_session_removals_total{reason=\"evicted\"}"]);
    }
  }
  EXPECT_GT(evictions_seen, 100);
}

// Sessions of 4 pages each (64 tokens of H 2, Dk 8, f32, pages of 16),
// created and filled by `token`'s caller.
class SessionShareTest : public SessionBudgetTest {
 protected:
  void StartWithTokens(ServerOptions options) {
    const std::string tokens = ::testing::TempDir() + "/share_tokens";
    std::ofstream(tokens) << "alice-token\nbob-token\n";
    options.auth_token_file = tokens;
    Start(options);
  }

  // A new session of `token`'s: one layer, H and Hkv 2, Dk 8, f32.
  SessionModel Small(const std::string& token) {
    return NewSession(1, 2, 2, 8, v1::FLOAT32, token);
  }

  // Fills `pages` more pages of `model`, `token`'s; its step's error (empty:
  // none).
  std::string Fill(SessionModel& model, int64_t pages, const std::string& token,
                   uint64_t seed) {
    v1::StepRequest request;
    *request.add_steps() = MakeStep(model, 0, 16 * pages, 0, seed);
    v1::StepResponse response;
    const grpc::Status status = Step(request, &response, token);
    if (!status.ok()) return status.error_message();
    return response.results(0).error().message();
  }

  grpc::Status Get(const SessionModel& model, const std::string& token) {
    v1::GetSessionRequest get;
    get.set_session_id(model.id);
    v1::GetSessionResponse got;
    return stub_->GetSession(Context(token).get(), get, &got);
  }

  v1::ListSessionsResponse List(const std::string& token) {
    v1::ListSessionsResponse listed;
    const grpc::Status status = stub_->ListSessions(
        Context(token).get(), v1::ListSessionsRequest(), &listed);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return listed;
  }
};

// At max_sessions without eviction, a caller holding none is not told to
// delete its sessions (an audit of 2026-12-07: bob, holding none, was), and
// one holding some is.
TEST_F(SessionShareTest, AFullServerAdvisesEachCallerByWhatItHolds) {
  ServerOptions options = Options();
  options.sessions.eviction = EvictionPolicy::kNone;
  options.sessions.max_sessions = 2;
  StartWithTokens(options);
  Small("alice-token");
  Small("alice-token");
  v1::CreateSessionRequest create = SmallSession();
  v1::CreateSessionResponse created;
  const grpc::Status bobs = Create(create, &created, "bob-token");
  EXPECT_EQ(bobs.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(bobs.error_message(),
              AllOf(HasSubstr("max_sessions 2 sessions and kv_eviction is "
                              "none; this caller holds none: retry after a "
                              "backoff"),
                    Not(HasSubstr("delete sessions"))));
  const grpc::Status alices = Create(create, &created, "alice-token");
  EXPECT_EQ(alices.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(alices.error_message(),
              AllOf(HasSubstr("; delete sessions you no longer need"),
                    Not(HasSubstr("holds none"))));
}

// One caller flooding a full cache evicts its own least recently used
// sessions, not an older one of another caller's; the other caller's growth
// then evicts the flooder's, telling it why.
TEST_F(SessionShareTest, AFloodingCallerEvictsItsOwnSessionsFirst) {
  ServerOptions options = Options();
  // 20 pages of 4 KiB, and room for the sessions' bookkeeping.
  options.memory.kv_cache_bytes = 20 * 4096 + 8192;
  StartWithTokens(options);
  SessionModel bobs = Small("bob-token");
  ASSERT_EQ(Fill(bobs, 4, "bob-token", 1), "");
  std::vector<SessionModel> alices;
  for (int i = 0; i < 12; ++i) {
    alices.push_back(Small("alice-token"));
    ASSERT_EQ(Fill(alices.back(), 4, "alice-token", 10 + i), "") << i;
  }
  // Bob's session, the oldest, is whole; alice kept her last four.
  EXPECT_TRUE(Get(bobs, "bob-token").ok());
  const grpc::Status first = Get(alices[0], "alice-token");
  EXPECT_EQ(first.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(first.error_message(),
              HasSubstr("evicted (least recently used) to make room in the KV "
                        "cache budget of 90112 bytes"));
  EXPECT_THAT(first.error_message(), Not(HasSubstr("another caller")));
  EXPECT_EQ(List("alice-token").sessions_size(), 4);
  // Bob grows by 4 pages: the caller holding the most, alice, gives up her
  // least recently used session, and is told why.
  ASSERT_EQ(Fill(bobs, 4, "bob-token", 2), "");
  EXPECT_TRUE(Get(bobs, "bob-token").ok());
  EXPECT_EQ(List("alice-token").sessions_size(), 3);
  const grpc::Status evicted = Get(alices[8], "alice-token");
  EXPECT_EQ(evicted.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(evicted.error_message(),
              HasSubstr("another caller needed the room, and yours held the "
                        "most"));
  v1::StepRequest request;
  *request.add_steps() = MakeStep(bobs, 0, 1, 1, 3);
  v1::StepResponse response;
  ASSERT_TRUE(Step(request, &response, "bob-token").ok());
  EXPECT_FALSE(response.results(0).has_error())
      << response.results(0).error().message();
  EXPECT_EQ(response.results(0).length(), 129);
  EXPECT_LE(Metrics()["attnserve_kv_cache_bytes"], 20 * 4096);
}

// At max_sessions, the caller holding the most sessions gives one up.
TEST_F(SessionShareTest, AtMaxSessionsTheCallerHoldingTheMostGivesOneUp) {
  ServerOptions options = Options();
  options.sessions.max_sessions = 6;
  StartWithTokens(options);
  std::vector<SessionModel> bobs;
  for (int i = 0; i < 2; ++i) {
    bobs.push_back(Small("bob-token"));
  }
  std::vector<SessionModel> alices;
  for (int i = 0; i < 10; ++i) {
    alices.push_back(Small("alice-token"));
  }
  for (const SessionModel& bob : bobs) EXPECT_TRUE(Get(bob, "bob-token").ok());
  EXPECT_EQ(List("alice-token").sessions_size(), 4);
  bobs.push_back(Small("bob-token"));
  for (const SessionModel& bob : bobs) EXPECT_TRUE(Get(bob, "bob-token").ok());
  EXPECT_EQ(List("alice-token").sessions_size(), 3);
  const grpc::Status evicted = Get(alices[6], "alice-token");
  EXPECT_EQ(evicted.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(evicted.error_message(),
              HasSubstr("for a new session under max_sessions 6; another "
                        "caller needed the room"));
  EXPECT_LE(Metrics()["attnserve_sessions"], 6);
}

// Each caller is held to its share: past it, its own least recently used
// sessions go (the other caller's stay, though the budget has room), or
// with kv_eviction none its new work is refused.
TEST_F(SessionShareTest, EachCallerIsHeldToItsShare) {
  for (const EvictionPolicy eviction :
       {EvictionPolicy::kLru, EvictionPolicy::kNone}) {
    SCOPED_TRACE(eviction == EvictionPolicy::kLru ? "lru" : "none");
    ServerOptions options = Options();
    options.sessions.eviction = eviction;
    options.sessions.max_sessions_per_identity = 3;
    // 8 pages and the bookkeeping of three sessions.
    const int64_t share = 8 * 4096 + 3 * (1024 + 48 + 4 * 16);
    options.sessions.kv_cache_bytes_per_identity = share;
    StartWithTokens(options);
    SessionModel bobs = Small("bob-token");
    ASSERT_EQ(Fill(bobs, 4, "bob-token", 1), "");
    std::vector<SessionModel> alices;
    for (int i = 0; i < 3; ++i) {
      alices.push_back(Small("alice-token"));
    }
    const v1::ListSessionsResponse listed = List("alice-token");
    EXPECT_EQ(listed.identity_budget_bytes(), share);
    EXPECT_EQ(listed.identity_max_sessions(), 3);
    EXPECT_EQ(listed.budget_bytes(), 64 << 20);
    ASSERT_EQ(Fill(alices[0], 4, "alice-token", 2), "");
    ASSERT_EQ(Fill(alices[1], 4, "alice-token", 3), "");
    // A fork shares its parent's pages: only its bookkeeping is charged,
    // and at three sessions alice's least recently used idle one (alices[2],
    // empty) gives way, or the fork is refused.
    v1::ForkSessionRequest fork;
    fork.set_session_id(alices[1].id);
    v1::ForkSessionResponse forked;
    grpc::Status status =
        stub_->ForkSession(Context("alice-token").get(), fork, &forked);
    const std::string third = Fill(alices[2], 1, "alice-token", 4);
    if (eviction == EvictionPolicy::kLru) {
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_THAT(third, HasSubstr("evicted (its caller's least recently "
                                   "used) to make room for a new session of "
                                   "its caller under max_sessions_per_identity "
                                   "3"));
    } else {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
      EXPECT_THAT(status.error_message(),
                  HasSubstr("this caller holds max_sessions_per_identity 3 "
                            "sessions and kv_eviction is none"));
      // alices[2] takes its page: 9 pages pass the share.
      EXPECT_THAT(third, HasSubstr("this caller's share of the KV cache "
                                   "(kv_cache_bytes_per_identity "));
      EXPECT_THAT(third, HasSubstr("kv_eviction is none"));
    }
    // More pages than the share allows: alices[0], the least recently used,
    // gives way (lru), or the step is refused (none).
    const std::string more = Fill(alices[1], 2, "alice-token", 5);
    const grpc::Status oldest = Get(alices[0], "alice-token");
    if (eviction == EvictionPolicy::kLru) {
      EXPECT_EQ(more, "");
      EXPECT_EQ(oldest.error_code(), grpc::StatusCode::NOT_FOUND);
      EXPECT_THAT(oldest.error_message(),
                  HasSubstr("evicted (its caller's least recently used) to "
                            "make room in its caller's share of the KV cache "
                            "(kv_cache_bytes_per_identity "));
    } else {
      EXPECT_THAT(more, HasSubstr("kv_eviction is none"));
      EXPECT_TRUE(oldest.ok());
    }
    // What counts against the share: the pages and the bookkeeping.
    const v1::ListSessionsResponse held = List("alice-token");
    EXPECT_LE(held.identity_held_bytes(), share);
    EXPECT_GT(held.identity_held_bytes(), held.total_bytes());
    // Bob's session is whole: alice's share is not his.
    EXPECT_TRUE(Get(bobs, "bob-token").ok());
    // A step larger than the whole share is refused, naming it.
    SessionModel big = Small("bob-token");
    EXPECT_THAT(Fill(big, 10, "bob-token", 6),
                HasSubstr("more than one caller may hold "
                          "(kv_cache_bytes_per_identity "));
    // A session whose one page passes the share could never take a token.
    v1::CreateSessionRequest wide = SmallSession();
    wide.set_key_dim(1024);  // 16 x 2 x 2048 x 4 bytes: 256 KiB a page.
    v1::CreateSessionResponse created;
    const grpc::Status refused = Create(wide, &created, "bob-token");
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(refused.error_message(),
                HasSubstr("over one caller's share "
                          "(kv_cache_bytes_per_identity) of "));
    server_.reset();
  }
}

}  // namespace
}  // namespace attnserve
