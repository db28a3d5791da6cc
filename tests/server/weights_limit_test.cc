// The --max_weights_bytes limit: PutWeights over it is RESOURCE_EXHAUSTED and
// leaves earlier sets in place, and a server whose demo weights do not fit
// fails to start.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attnserve/server/server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "server/server_fixture.h"
#include "server/weights_helpers.h"

namespace attnserve {
namespace {

using ::attnserve::testing::Expected;
using ::attnserve::testing::ExpectNear;
using ::attnserve::testing::kAbs;
using ::attnserve::testing::kRel;
using ::attnserve::testing::kSelfShape;
using ::attnserve::testing::kTimeout;
using ::attnserve::testing::MakeRequest;
using ::attnserve::testing::MakeWeights;
using ::attnserve::testing::NamesOf;
using ::attnserve::testing::PutRequest;
using ::attnserve::testing::ServerFixture;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const v1::WeightsInfo* FindInfo(const v1::ListWeightsResponse& list,
                                const std::string& name) {
  for (const v1::WeightsInfo& info : list.weights()) {
    if (info.name() == name) return &info;
  }
  return nullptr;
}

using WeightsLimitTest = ServerFixture;

TEST_F(WeightsLimitTest, PutOverLimitIsResourceExhaustedAndEarlierSetsRemain) {
  const v1::ProjectionWeights small = MakeWeights(kSelfShape, 1);
  const v1::ProjectionWeights big =
      MakeWeights({1, 1, 1, 16, 16, 4, 4, 4, 4}, 2);
  // The bytes each set takes, as the server counts them, from the default
  // server.
  absl::StatusOr<v1::PutWeightsResponse> small_put =
      client_->PutWeights(PutRequest("small", small), kTimeout);
  ASSERT_TRUE(small_put.ok()) << small_put.status();
  absl::StatusOr<v1::PutWeightsResponse> big_put =
      client_->PutWeights(PutRequest("big", big), kTimeout);
  ASSERT_TRUE(big_put.ok()) << big_put.status();
  absl::StatusOr<v1::ListWeightsResponse> list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  const v1::WeightsInfo* demo = FindInfo(*list, "demo");
  ASSERT_NE(demo, nullptr);
  const int64_t demo_bytes = demo->bytes();
  const int64_t small_bytes = small_put->bytes();
  const int64_t big_bytes = big_put->bytes();
  ASSERT_GT(big_bytes, small_bytes);

  // Room for demo and either set, not both.
  ServerOptions options = DefaultOptions();
  options.memory.max_weights_bytes = demo_bytes + small_bytes + big_bytes - 1;
  StartServer(options);
  if (HasFatalFailure()) return;

  small_put = client_->PutWeights(PutRequest("small", small), kTimeout);
  ASSERT_TRUE(small_put.ok()) << small_put.status();
  const absl::Status refused =
      client_->PutWeights(PutRequest("big", big), kTimeout).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("weights 'big' need ", big_bytes)));
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("holds ", demo_bytes + small_bytes)));
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr(absl::StrCat("max_weights_bytes limit of ",
                                     options.memory.max_weights_bytes)));

  list = client_->ListWeights(kTimeout);
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(NamesOf(*list), ElementsAre("demo", "small"));
  EXPECT_EQ(list->total_bytes(), demo_bytes + small_bytes);
  v1::MultiHeadAttentionRequest request =
      MakeRequest(kSelfShape, 3, /*cross=*/false);
  request.set_weights_name("small");
  absl::StatusOr<v1::MultiHeadAttentionResponse> response =
      client_->MultiHeadAttention(request, kTimeout);
  ASSERT_TRUE(response.ok()) << response.status();
  ExpectNear(response->output(), Expected(kSelfShape, request, small).output,
             kAbs, kRel, "output");

  // Replacing a set counts the bytes it frees; deleting makes room.
  EXPECT_TRUE(client_->PutWeights(PutRequest("small", small), kTimeout).ok());
  ASSERT_TRUE(client_->DeleteWeights("small", kTimeout).ok());
  const absl::StatusOr<v1::PutWeightsResponse> fits =
      client_->PutWeights(PutRequest("big", big), kTimeout);
  EXPECT_TRUE(fits.ok()) << fits.status();
}

TEST_F(WeightsLimitTest, StartFailsWhenDemoWeightsDoNotFit) {
  ServerOptions options = DefaultOptions();
  options.memory.max_weights_bytes = 1000;
  const absl::StatusOr<std::unique_ptr<AttnServer>> server =
      AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kResourceExhausted)
      << server.status();
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("weights 'demo'"));
  EXPECT_THAT(std::string(server.status().message()),
              HasSubstr("max_weights_bytes limit of 1000"));
}

}  // namespace
}  // namespace attnserve
