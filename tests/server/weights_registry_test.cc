// The projection-weights registry end to end: PutWeights, ListWeights and
// DeleteWeights, and MultiHeadAttention with registered weights (weights_name)
// against the naive reference.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attnserve/server/weights/weights_loader.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"
#include "server/weights_helpers.h"

namespace attnserve {
namespace {

using ::attnserve::testing::Biases;
using ::attnserve::testing::ExpectDims;
using ::attnserve::testing::Expected;
using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::kAbs;
using ::attnserve::testing::kCrossShape;
using ::attnserve::testing::kRel;
using ::attnserve::testing::kSelfShape;
using ::attnserve::testing::kTimeout;
using ::attnserve::testing::MakeRequest;
using ::attnserve::testing::MakeWeights;
using ::attnserve::testing::NamesOf;
using ::attnserve::testing::PutRequest;
using ::attnserve::testing::ReferenceMhaShape;
using ::attnserve::testing::ServerFixture;
using ::attnserve::testing::ValuesOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// The largest absolute difference between two equally sized tensors.
double MaxDifference(const v1::Tensor& a, const v1::Tensor& b) {
  const std::vector<float> x = ValuesOf(a);
  const std::vector<float> y = ValuesOf(b);
  EXPECT_EQ(x.size(), y.size());
  double largest = 0.0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) {
    largest = std::max(largest, std::abs(double{x[i]} - double{y[i]}));
  }
  return largest;
}

using WeightsRegistryTest = ServerFixture;

TEST_F(WeightsRegistryTest, DemoWeightsAreListedAtStart) {
  EXPECT_THAT(server_->startup_weights(), ElementsAre("demo"));
  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("demo"));
  ExpectDims(list->weights(0), {1, 1, 1, 64, 64, 8, 8, 8, 8},
             /*has_bias=*/true);
  EXPECT_EQ(list->total_bytes(), list->weights(0).bytes());
}

TEST_F(WeightsRegistryTest, DemoWeightsMatchReference) {
  const ReferenceMhaShape s{1, 4, 4, 64, 64, 8, 8, 8, 8};
  v1::MultiHeadAttentionRequest request = MakeRequest(s, 3, /*cross=*/false);
  request.set_weights_name("demo");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_GT(response->weights_version(), 0);
  EXPECT_THAT(response->output().shape(), ElementsAre(1, 4, 64));
  ExpectNear(response->output(),
             Expected(s, request, DemoWeights().weights()).output, kAbs, kRel,
             "output");
}

TEST_F(WeightsRegistryTest, PutWeightsReturnsVersionAndBytesAndListIsSorted) {
  absl::StatusOr<v1::PutWeightsResponse> zeta = client_->PutWeights(
      PutRequest("zeta", MakeWeights(kSelfShape, 1)), kTimeout);
  ASSERT_TRUE(zeta.ok()) << zeta.status();
  absl::StatusOr<v1::PutWeightsResponse> alpha = client_->PutWeights(
      PutRequest("alpha.v1_x-y", MakeWeights(kCrossShape, 2, Biases::kNone)),
      kTimeout);
  ASSERT_TRUE(alpha.ok()) << alpha.status();
  EXPECT_GT(zeta->version(), 0);
  EXPECT_GT(alpha->version(), zeta->version());
  EXPECT_GT(zeta->bytes(), 0);
  EXPECT_GT(alpha->bytes(), 0);

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("alpha.v1_x-y", "demo", "zeta"));
  ExpectDims(list->weights(0), kCrossShape, /*has_bias=*/false);
  ExpectDims(list->weights(2), kSelfShape, /*has_bias=*/true);
  EXPECT_EQ(list->weights(0).version(), alpha->version());
  EXPECT_EQ(list->weights(0).bytes(), alpha->bytes());
  EXPECT_EQ(list->weights(2).version(), zeta->version());
  EXPECT_EQ(list->weights(2).bytes(), zeta->bytes());
  EXPECT_EQ(list->total_bytes(),
            alpha->bytes() + list->weights(1).bytes() + zeta->bytes());
}

// A self-attention set holds each of its values once: Q, K and V stacked
// for the fused projection are the only copy of them (until 2026-12-06 they
// were held twice, and a set counted 1.75 times its values), plus the stacked
// bias when it has biases.
TEST_F(WeightsRegistryTest, ASelfAttentionSetHoldsItsValuesOnce) {
  const auto elements = [](const v1::Tensor& tensor) {
    int64_t n = 1;
    for (const int64_t dim : tensor.shape()) n *= dim;
    return n;
  };
  const v1::ProjectionWeights plain = MakeWeights(kSelfShape, 3, Biases::kNone);
  absl::StatusOr<v1::PutWeightsResponse> put =
      client_->PutWeights(PutRequest("plain", plain), kTimeout);
  ASSERT_TRUE(put.ok()) << put.status();
  const int64_t weights = elements(plain.w_q()) + elements(plain.w_k()) +
                          elements(plain.w_v()) + elements(plain.w_o());
  EXPECT_EQ(put->bytes(),
            weights * int64_t{sizeof(float)} + kWeightSetOverheadBytes);
  const v1::ProjectionWeights biased = MakeWeights(kSelfShape, 4);
  put = client_->PutWeights(PutRequest("biased", biased), kTimeout);
  ASSERT_TRUE(put.ok()) << put.status();
  const int64_t biases = elements(biased.b_q()) + elements(biased.b_k()) +
                         elements(biased.b_v()) + elements(biased.b_o());
  const int64_t stacked_bias =
      elements(biased.b_q()) + elements(biased.b_k()) + elements(biased.b_v());
  EXPECT_EQ(put->bytes(),
            (weights + biases + stacked_bias) * int64_t{sizeof(float)} +
                kWeightSetOverheadBytes);
}

TEST_F(WeightsRegistryTest, WeightsNameMatchesReferenceAndReportsVersion) {
  const v1::ProjectionWeights self_weights = MakeWeights(kSelfShape, 11);
  const v1::ProjectionWeights cross_weights = MakeWeights(kCrossShape, 21);
  absl::StatusOr<v1::PutWeightsResponse> self_put =
      client_->PutWeights(PutRequest("self", self_weights), kTimeout);
  ASSERT_TRUE(self_put.ok()) << self_put.status();
  absl::StatusOr<v1::PutWeightsResponse> cross_put =
      client_->PutWeights(PutRequest("cross", cross_weights), kTimeout);
  ASSERT_TRUE(cross_put.ok()) << cross_put.status();

  // Self-attention with registered weights (E == Ekv: the fused projection).
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 31, /*cross=*/false);
  request.set_weights_name("self");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->weights_version(), self_put->version());
  EXPECT_EQ(response->output().dtype(), v1::FLOAT32);
  EXPECT_THAT(response->output().shape(), ElementsAre(2, 5, 8));
  ExpectNear(response->output(),
             Expected(kSelfShape, request, self_weights).output, kAbs, kRel,
             "self output");

  // The same E == Ekv weights used for cross-attention (separate projections).
  ReferenceMhaShape cross_self = kSelfShape;
  cross_self.key_len = 3;
  request = MakeRequest(cross_self, 41, /*cross=*/true);
  request.set_weights_name("self");
  response = client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->weights_version(), self_put->version());
  ExpectNear(response->output(),
             Expected(cross_self, request, self_weights).output, kAbs, kRel,
             "self weights, cross-attention output");

  // Registered grouped-query weights with Ekv != E.
  request = MakeRequest(kCrossShape, 51, /*cross=*/true);
  request.set_weights_name("cross");
  response = client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->weights_version(), cross_put->version());
  EXPECT_THAT(response->output().shape(), ElementsAre(2, 3, 8));
  ExpectNear(response->output(),
             Expected(kCrossShape, request, cross_weights).output, kAbs, kRel,
             "cross output");
}

TEST_F(WeightsRegistryTest, RegisteredWeightsWithSomeBiasesMatchReference) {
  // b_q and b_o only: the fused self-attention bias has zeros for K and V.
  const v1::ProjectionWeights weights =
      MakeWeights(kSelfShape, 61, Biases::kQueryAndOutputOnly);
  ASSERT_TRUE(
      client_->PutWeights(PutRequest("partial", weights), kTimeout).ok());
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 71, /*cross=*/false);
  request.set_weights_name("partial");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectNear(response->output(), Expected(kSelfShape, request, weights).output,
             kAbs, kRel, "output");
}

TEST_F(WeightsRegistryTest, SecondPutRaisesVersionAndNextCallUsesNewValues) {
  const v1::ProjectionWeights first = MakeWeights(kSelfShape, 101);
  const v1::ProjectionWeights second = MakeWeights(kSelfShape, 202);
  absl::StatusOr<v1::PutWeightsResponse> first_put =
      client_->PutWeights(PutRequest("model", first), kTimeout);
  ASSERT_TRUE(first_put.ok()) << first_put.status();

  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 303, /*cross=*/false);
  request.set_weights_name("model");
  absl::StatusOr<v1::MultiHeadAttentionResponse> before =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->weights_version(), first_put->version());
  ExpectNear(before->output(), Expected(kSelfShape, request, first).output,
             kAbs, kRel, "output before");

  absl::StatusOr<v1::PutWeightsResponse> second_put =
      client_->PutWeights(PutRequest("model", second), kTimeout);
  ASSERT_TRUE(second_put.ok()) << second_put.status();
  EXPECT_GT(second_put->version(), first_put->version());
  EXPECT_EQ(second_put->bytes(), first_put->bytes());

  absl::StatusOr<v1::MultiHeadAttentionResponse> after =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->weights_version(), second_put->version());
  ExpectNear(after->output(), Expected(kSelfShape, request, second).output,
             kAbs, kRel, "output after");
  EXPECT_GT(MaxDifference(before->output(), after->output()), 1e-2);

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_THAT(NamesOf(*list), ElementsAre("demo", "model"));
  EXPECT_EQ(list->weights(1).version(), second_put->version());
  EXPECT_EQ(list->total_bytes(),
            list->weights(0).bytes() + second_put->bytes());
}

TEST_F(WeightsRegistryTest, DeleteWeightsReturnsInfoThenNameIsNotFound) {
  absl::StatusOr<v1::PutWeightsResponse> put = client_->PutWeights(
      PutRequest("doomed", MakeWeights(kCrossShape, 5)), kTimeout);
  ASSERT_TRUE(put.ok()) << put.status();

  absl::StatusOr<v1::DeleteWeightsResponse> deleted =
      client_->DeleteWeights("doomed", kTimeout);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  EXPECT_EQ(deleted->deleted().name(), "doomed");
  EXPECT_EQ(deleted->deleted().version(), put->version());
  EXPECT_EQ(deleted->deleted().bytes(), put->bytes());
  ExpectDims(deleted->deleted(), kCrossShape, /*has_bias=*/true);

  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(NamesOf(*list), ElementsAre("demo"));
  EXPECT_EQ(list->total_bytes(), list->weights(0).bytes());

  v1::MultiHeadAttentionRequest request =
      MakeRequest(kCrossShape, 6, /*cross=*/true);
  request.set_weights_name("doomed");
  const absl::Status call =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(call.code(), absl::StatusCode::kNotFound) << call;
  EXPECT_THAT(std::string(call.message()), HasSubstr("'doomed'"));

  const absl::Status again =
      client_->DeleteWeights("doomed", kTimeout).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("'doomed'"));
}

// With --weights_admin_token_file, only its tokens put or delete weight sets;
// every other admitted caller still lists and uses them.
TEST_F(WeightsRegistryTest, OnlyAnAdminTokenChangesWeightSets) {
  const std::string callers = ::testing::TempDir() + "/weights_callers";
  const std::string admins = ::testing::TempDir() + "/weights_admins";
  std::ofstream(callers) << "caller-token\n";
  std::ofstream(admins) << "# who may change weights\nadmin-token\n";
  for (const bool with_caller_tokens : {true, false}) {
    SCOPED_TRACE(with_caller_tokens ? "auth_token_file too" : "admins alone");
    ServerOptions options = DefaultOptions();
    if (with_caller_tokens) options.auth_token_file = callers;
    options.weights_admin_token_file = admins;
    options.transport.max_message_bytes = 64 << 10;
    server_.reset();
    StartServer(options);
    const auto connect = [this](const std::string& token) {
      ClientOptions client_options;
      client_options.bearer_token = token;
      return Client::Connect(absl::StrCat("127.0.0.1:", server_->port()),
                             client_options)
          .value();
    };
    std::unique_ptr<Client> caller = connect("caller-token");
    std::unique_ptr<Client> admin = connect("admin-token");
    std::unique_ptr<Client> anonymous = connect("");
    const v1::PutWeightsRequest put =
        PutRequest("shared", MakeWeights(kSelfShape, 3));
    absl::Status status = caller->PutWeights(put, kTimeout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("needs a token of weights_admin_token_file"));
    status = anonymous->PutWeights(put, kTimeout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
    // Refused on its headers, before its message is read: a non-admin's
    // PutWeights past the largest message the server reads is denied, where
    // an admin's is refused for its size.
    v1::PutWeightsRequest oversized = put;
    oversized.set_name(std::string(128 << 10, 'n'));
    status = caller->PutWeights(oversized, kTimeout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    status = anonymous->PutWeights(oversized, kTimeout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnauthenticated) << status;
    status = admin->PutWeights(oversized, kTimeout).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    ASSERT_TRUE(admin->PutWeights(put, kTimeout).ok());
    // Every caller uses the set; the admin is admitted to every call too.
    v1::MultiHeadAttentionRequest request =
        MakeRequest(kSelfShape, 4, /*cross=*/false);
    request.set_weights_name("shared");
    EXPECT_TRUE(caller->MultiHeadAttention(request, kTimeout).ok());
    EXPECT_TRUE(admin->MultiHeadAttention(request, kTimeout).ok());
    EXPECT_EQ(anonymous->MultiHeadAttention(request, kTimeout).status().code(),
              with_caller_tokens ? absl::StatusCode::kUnauthenticated
                                 : absl::StatusCode::kOk);
    for (const char* name : {"shared", "demo"}) {
      status = caller->DeleteWeights(name, kTimeout).status();
      EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << status;
    }
    absl::StatusOr<v1::ListWeightsResponse> list =
        caller->ListWeights(kTimeout);
    ASSERT_TRUE(list.ok()) << list.status();
    EXPECT_THAT(NamesOf(*list), ElementsAre("demo", "shared"));
    EXPECT_TRUE(admin->DeleteWeights("shared", kTimeout).ok());
  }
}

// Names are checked before use, and echoed at most 256 bytes, cut on a UTF-8
// character boundary.
TEST_F(WeightsRegistryTest, DeleteWeightsChecksTheNameAndEchoesItBounded) {
  const std::string huge(1 << 20, 'n');
  const absl::Status status = client_->DeleteWeights(huge, kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("…\" (1048576 bytes), expected 1 to 128 characters"));
  EXPECT_LT(status.message().size(), 400u);

  std::string accents = "a";
  while (accents.size() < 600)
    accents += "é";  // Two bytes each, at odd offsets.
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 8, /*cross=*/false);
  request.set_weights_name(accents);
  const absl::Status named =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(named.code(), absl::StatusCode::kInvalidArgument) << named;
  const std::string message(named.message());
  EXPECT_THAT(message, HasSubstr("éé…\" (" + std::to_string(accents.size()) +
                                 " bytes)"));
}

// ListWeights answers a page at a time (as many sets as fit in a message, at
// most page_size); the C++ client walks every page.
TEST_F(WeightsRegistryTest, ListWeightsAnswersPagesThatTheClientWalks) {
  ServerOptions options = DefaultOptions();
  options.transport.max_message_bytes = 8192;
  StartServer(options);
  if (HasFatalFailure()) return;
  const v1::ProjectionWeights tiny =
      MakeWeights({1, 1, 1, 2, 2, 1, 1, 2, 2}, 3);
  std::vector<std::string> names = {"demo"};
  for (int i = 0; i < 300; ++i) {
    names.push_back(absl::StrCat("set-", absl::Dec(i, absl::kZeroPad3)));
    ASSERT_TRUE(
        client_->PutWeights(PutRequest(names.back(), tiny), kTimeout).ok());
  }
  auto stub = v1::AttentionService::NewStub(client_->channel());
  const auto list = [&stub](int64_t page_size, const std::string& token,
                            v1::ListWeightsResponse* response) {
    grpc::ClientContext context;
    v1::ListWeightsRequest request;
    request.set_page_size(page_size);
    request.set_page_token(token);
    return stub->ListWeights(&context, request, response);
  };
  v1::ListWeightsResponse first, second, last;
  ASSERT_TRUE(list(2, "", &first).ok());
  EXPECT_THAT(NamesOf(first), ElementsAre("demo", "set-000"));
  EXPECT_EQ(first.next_page_token(), "set-000");
  ASSERT_TRUE(list(2, first.next_page_token(), &second).ok());
  EXPECT_THAT(NamesOf(second), ElementsAre("set-001", "set-002"));
  EXPECT_EQ(second.total_bytes(), first.total_bytes());
  ASSERT_TRUE(list(5, "set-298", &last).ok());
  EXPECT_THAT(NamesOf(last), ElementsAre("set-299"));
  EXPECT_EQ(last.next_page_token(), "");
  // As many as fit in 8 KiB: fewer than all 301.
  v1::ListWeightsResponse fitting;
  ASSERT_TRUE(list(0, "", &fitting).ok());
  EXPECT_GT(fitting.weights_size(), 10);
  EXPECT_LT(fitting.weights_size(), 301);
  EXPECT_LE(static_cast<int64_t>(fitting.ByteSizeLong()), 8192);
  EXPECT_FALSE(fitting.next_page_token().empty());
  // The client walks the pages.
  absl::StatusOr<v1::ListWeightsResponse> all = client_->ListWeights(kTimeout);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(NamesOf(*all), names);
  int64_t sum = 0;
  for (const v1::WeightsInfo& info : all->weights()) sum += info.bytes();
  EXPECT_EQ(all->total_bytes(), sum);
  // Bad requests.
  v1::ListWeightsResponse refused;
  const grpc::Status negative = list(-1, "", &refused);
  EXPECT_EQ(negative.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(
      negative.error_message(),
      HasSubstr("page_size is -1, expected 0 (as many as fit) or more"));
  const grpc::Status token = list(0, "not a name", &refused);
  EXPECT_EQ(token.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(token.error_message(),
              HasSubstr("page_token is \"not a name\", expected empty or the "
                        "next_page_token of a ListWeights answer"));
}

// Each set costs 1 KiB of --max_weights_bytes beyond its values, so a flood of
// tiny sets stops at the limit.
TEST_F(WeightsRegistryTest, TinySetsAreBoundedByTheLimitToo) {
  ServerOptions options = DefaultOptions();
  options.demo_weights = false;
  options.memory.max_weights_bytes = 64 << 10;
  StartServer(options);
  if (HasFatalFailure()) return;
  const v1::ProjectionWeights tiny =
      MakeWeights({1, 1, 1, 2, 2, 1, 1, 1, 1}, 4);
  int held = 0;
  absl::Status refused;
  for (int i = 0; i < 200 && refused.ok(); ++i) {
    absl::StatusOr<v1::PutWeightsResponse> put = client_->PutWeights(
        PutRequest(absl::StrCat("tiny-", i), tiny), kTimeout);
    if (put.ok()) {
      ++held;
      EXPECT_GT(put->bytes(), 1024);
    } else {
      refused = put.status();
    }
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_weights_bytes limit of 65536"));
  EXPECT_GT(held, 32);
  EXPECT_LT(held, 64);
}

TEST_F(WeightsRegistryTest, UnknownWeightsNameIsNotFoundNamingIt) {
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 8, /*cross=*/false);
  request.set_weights_name("never-registered");
  const absl::Status status =
      client_->MultiHeadAttention(request, kTimeout).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("weights_name 'never-registered' is not registered"));
}

}  // namespace
}  // namespace attnserve
