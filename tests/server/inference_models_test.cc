// The Open Inference Protocol's translation (server/oip): what ModelConfig
// tells a Triton client, how ModelStatistics keeps its pairs, and parameters
// and messages in the protocol's names.
#include "attnserve/server/oip/inference_models.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve::oip {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const inference::ModelInput* FindInput(const inference::ModelConfig& config,
                                       const std::string& name) {
  for (const inference::ModelInput& input : config.input()) {
    if (input.name() == name) return &input;
  }
  return nullptr;
}

// A client that leaves out optional inputs must still be answered: KV_INPUT
// is optional only where self-attention can do without it.
TEST(InferenceModelsTest, KvInputIsOptionalOnlyWhereEkvIsE) {
  const inference::ModelConfig self =
      WeightSetConfig("self", WeightsShape{64, 64, 8, 8, 8, 8});
  const inference::ModelConfig cross =
      WeightSetConfig("cross", WeightsShape{64, 12, 8, 8, 8, 8});
  const inference::ModelInput* kv = FindInput(self, "KV_INPUT");
  ASSERT_NE(kv, nullptr);
  EXPECT_TRUE(kv->optional());
  kv = FindInput(cross, "KV_INPUT");
  ASSERT_NE(kv, nullptr);
  EXPECT_FALSE(kv->optional());
}

// Past kMaxModels pairs the least recently recorded goes, so that a set
// re-put many times (each put a new version) is still counted at its current
// version.
TEST(InferenceModelsTest, StatisticsDropTheLeastRecentlyRecordedPair) {
  InferenceStatistics statistics;
  const absl::Time now = absl::Now();
  statistics.Record("kept", "1", true, absl::Milliseconds(1), 1, 1, now);
  for (size_t v = 0; v < InferenceStatistics::kMaxModels + 10; ++v) {
    statistics.Record("set", absl::StrCat(v), true, absl::Milliseconds(1), 1, 1,
                      now);
    if (v % 100 == 0) {  // Keeps "kept" recent.
      statistics.Record("kept", "1", true, absl::Milliseconds(1), 1, 1, now);
    }
  }
  const std::string newest = absl::StrCat(InferenceStatistics::kMaxModels + 9);
  EXPECT_EQ(statistics.Of("set", newest).inference_count(), 1);
  EXPECT_EQ(statistics.Of("kept", "1").inference_count(),
            1 + (InferenceStatistics::kMaxModels + 10 + 99) / 100);
  EXPECT_EQ(statistics.Of("set", "0").inference_count(), 0);  // Dropped.
}

inference::ModelInferRequest SdpaRequest() {
  inference::ModelInferRequest request;
  request.set_model_name(kSdpaModel);
  for (const char* name : {"QUERY", "KEY", "VALUE"}) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int64_t d : {1, 1, 1, 1}) input->add_shape(d);
    request.add_raw_input_contents(std::string(4, '\0'));
  }
  return request;
}

// A double past float's range is refused as itself, not as the infinity it
// would narrow to.
TEST(InferenceModelsTest, ADoubleParameterPastFloatRangeIsNamedAsSent) {
  for (const char* name : {"scale", "softcap"}) {
    inference::ModelInferRequest request = SdpaRequest();
    (*request.mutable_parameters())[name].set_double_param(1e300);
    RequestedOutputs outputs;
    const absl::StatusOr<v1::AttendRequest> attend =
        AttendRequestFrom(request, &outputs);
    EXPECT_EQ(attend.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(attend.status().message(),
                HasSubstr(absl::StrCat("parameter ", name,
                                       " is 1e+300, expected a finite number "
                                       "within float32's range")));
  }
}

// An empty KEY_LENGTHS would read as none at all.
TEST(InferenceModelsTest, AnEmptyKeyLengthsIsRefused) {
  inference::ModelInferRequest request = SdpaRequest();
  auto* input = request.add_inputs();
  input->set_name("KEY_LENGTHS");
  input->set_datatype("INT64");
  input->add_shape(0);
  request.add_raw_input_contents("");
  RequestedOutputs outputs;
  const absl::StatusOr<v1::AttendRequest> attend =
      AttendRequestFrom(request, &outputs);
  EXPECT_EQ(attend.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(attend.status().message(),
              HasSubstr("input KEY_LENGTHS has shape [0], expected [B]"));
}

// Fields named alone take the protocol's names; the same words in prose stay.
TEST(InferenceModelsTest, MessagesRenameFieldsNotProse) {
  const absl::Status renamed = InProtocolNames(
      absl::InvalidArgumentError("query is missing; key has 9 elements; each "
                                 "kv head serves H / Hkv query heads; "
                                 "value.shape[3] (Dv)"),
      /*weight_set=*/false);
  EXPECT_THAT(renamed.message(), HasSubstr("QUERY is missing"));
  EXPECT_THAT(renamed.message(), HasSubstr("KEY has 9 elements"));
  EXPECT_THAT(renamed.message(), HasSubstr("H / Hkv query heads"));
  EXPECT_THAT(renamed.message(), HasSubstr("VALUE.shape[3] (Dv)"));
  EXPECT_THAT(renamed.message(), Not(HasSubstr("QUERY heads")));
}

}  // namespace
}  // namespace attnserve::oip
