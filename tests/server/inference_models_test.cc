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
    // And one float rounds to 0, as itself, not as the 0 it would become.
    (*request.mutable_parameters())[name].set_double_param(1e-300);
    const absl::StatusOr<v1::AttendRequest> tiny =
        AttendRequestFrom(request, &outputs);
    EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(tiny.status().message(),
                HasSubstr(absl::StrCat("parameter ", name,
                                       " is 1e-300, which float32 rounds to "
                                       "0; expected 0 or a number float32 "
                                       "holds")));
  }
}

// A softcap under the smallest normal float is named as sent, not as the
// float it would become (until 2026-12-07, 1e-40 as 9.9999461e-41).
TEST(InferenceModelsTest, ASoftcapTooSmallIsNamedAsSent) {
  for (const double softcap : {1e-40, -0.1, 0.0}) {
    inference::ModelInferRequest request = SdpaRequest();
    (*request.mutable_parameters())["softcap"].set_double_param(softcap);
    RequestedOutputs outputs;
    const absl::Status status = AttendRequestFrom(request, &outputs).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(),
                HasSubstr(absl::StrCat("parameter softcap is ", softcap,
                                       ", expected a finite number >= "
                                       "1.17549435e-38")));
  }
}

// With outputs listed, the parameters' lse and weights that the list leaves
// out are not computed (nor counted in the answer's size).
TEST(InferenceModelsTest, OutputsLeftOutOfTheListAreNotComputed) {
  inference::ModelInferRequest request = SdpaRequest();
  (*request.mutable_parameters())["return_lse"].set_bool_param(true);
  (*request.mutable_parameters())["return_weights"].set_string_param(
      "head_mean");
  request.add_outputs()->set_name("OUTPUT");
  inference::ModelInferRequest listed = request;
  RequestedOutputs outputs;
  absl::StatusOr<v1::AttendRequest> attend =
      AttendRequestFrom(listed, &outputs);
  ASSERT_TRUE(attend.ok()) << attend.status();
  EXPECT_FALSE(attend->options().return_lse());
  EXPECT_EQ(attend->options().return_weights(), v1::AttentionOptions::NONE);
  EXPECT_TRUE(outputs.output && !outputs.lse && !outputs.weights);
  // Listed, WEIGHTS keeps the parameter's kind.
  request.add_outputs()->set_name("WEIGHTS");
  attend = AttendRequestFrom(request, &outputs);
  ASSERT_TRUE(attend.ok()) << attend.status();
  EXPECT_FALSE(attend->options().return_lse());
  EXPECT_EQ(attend->options().return_weights(),
            v1::AttentionOptions::HEAD_MEAN);
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
  // A byte count names the protocol's datatype.
  const absl::Status bytes = InProtocolNames(
      absl::InvalidArgumentError("query.data has 31 bytes, expected 32 (8 "
                                 "elements of shape [1, 1, 2, 4] x 4 bytes of "
                                 "FLOAT32)"),
      /*weight_set=*/false);
  EXPECT_THAT(bytes.message(),
              HasSubstr("input QUERY's data (raw_input_contents or contents) "
                        "has 31 bytes, expected 32 (8 elements of shape [1, 1, "
                        "2, 4] x 4 bytes of FP32)"));
  const absl::Status huge = InProtocolNames(
      absl::InvalidArgumentError("query.shape is [4611686018427387904, 4, 1, "
                                 "1]: its FLOAT32 data would pass 2^63 bytes"),
      /*weight_set=*/false);
  EXPECT_THAT(huge.message(), HasSubstr(": its FP32 data would pass 2^63"));
}

// What attnserve does not offer is refused, naming it: tensor parameters
// (Triton's shared memory, classification; an output's binary_data, HTTP's,
// is taken and means nothing here), and an id too long to echo.
TEST(InferenceModelsTest, TensorParametersAndLongIdsAreRefusedByName) {
  RequestedOutputs outputs;
  inference::ModelInferRequest request = SdpaRequest();
  auto* output = request.add_outputs();
  output->set_name("OUTPUT");
  (*output->mutable_parameters())["binary_data"].set_bool_param(true);
  request.set_id(std::string(kMaxInferIdBytes, 'i'));
  ASSERT_TRUE(AttendRequestFrom(request, &outputs).ok());

  (*output->mutable_parameters())["classification"].set_int64_param(3);
  absl::Status refused = AttendRequestFrom(request, &outputs).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(),
              HasSubstr("output \"OUTPUT\" has parameter \"classification\", "
                        "expected none or binary_data"));

  request = SdpaRequest();
  (*request.mutable_inputs(1)->mutable_parameters())["shared_memory_region"]
      .set_string_param("region");
  refused = AttendRequestFrom(request, &outputs).status();
  EXPECT_THAT(refused.message(),
              HasSubstr("input \"KEY\" has parameter "
                        "\"shared_memory_region\", expected none"));

  request = SdpaRequest();
  request.set_id(std::string(kMaxInferIdBytes + 1, 'i'));
  refused = AttendRequestFrom(request, &outputs).status();
  EXPECT_THAT(refused.message(),
              HasSubstr("id is 513 bytes, expected at most 512"));
}

// KServe's and Triton's clients send each binary input with its byte count,
// binary_data_size (their HTTP binding's framing): taken where it is an int64
// equal to the input's raw_input_contents entry, and refused, naming it,
// otherwise (until 2026-12-07 every such request was refused, an audit
// found); an output's binary_data must be a bool.
TEST(InferenceModelsTest, BinaryDataSizeIsTakenWhereItIsTheInputsBytes) {
  RequestedOutputs outputs;
  inference::ModelInferRequest request = SdpaRequest();
  for (auto& input : *request.mutable_inputs()) {
    (*input.mutable_parameters())["binary_data_size"].set_int64_param(4);
  }
  auto* output = request.add_outputs();
  output->set_name("OUTPUT");
  (*output->mutable_parameters())["binary_data"].set_bool_param(true);
  {
    inference::ModelInferRequest taken = request;  // Its bytes move out.
    const absl::Status status = AttendRequestFrom(taken, &outputs).status();
    ASSERT_TRUE(status.ok()) << status;
  }

  struct Case {
    const char* what;
    void (*mutate)(inference::ModelInferRequest&);
    const char* expected;
  };
  const Case cases[] = {
      {"another count",
       [](inference::ModelInferRequest& r) {
         (*r.mutable_inputs(1)->mutable_parameters())["binary_data_size"]
             .set_int64_param(5);
       },
       "input \"KEY\" has parameter binary_data_size, expected it an "
       "int64_param equal to its raw_input_contents entry's 4 bytes"},
      {"a string",
       [](inference::ModelInferRequest& r) {
         (*r.mutable_inputs(0)->mutable_parameters())["binary_data_size"]
             .set_string_param("4");
       },
       "input \"QUERY\" has parameter binary_data_size, expected it an "
       "int64_param equal to"},
      {"typed contents",
       [](inference::ModelInferRequest& r) {
         r.clear_raw_input_contents();
         for (auto& input : *r.mutable_inputs()) {
           input.mutable_contents()->add_fp32_contents(0.5f);
         }
       },
       "input \"QUERY\" has parameter binary_data_size, expected it an "
       "int64_param of an input in raw_input_contents (this one is not)"},
      {"binary_data as a string",
       [](inference::ModelInferRequest& r) {
         (*r.mutable_outputs(0)->mutable_parameters())["binary_data"]
             .set_string_param("yes");
       },
       "output \"OUTPUT\" has parameter binary_data, expected a bool_param"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    inference::ModelInferRequest mutated = request;
    c.mutate(mutated);
    const absl::Status refused = AttendRequestFrom(mutated, &outputs).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(refused.message(), HasSubstr(c.expected));
  }
}

// Typed contents in another type's field are refused, naming both fields, not
// read as no values; junk beside the right field is refused too.
TEST(InferenceModelsTest, ContentsInAnotherTypesFieldAreNamed) {
  RequestedOutputs outputs;
  inference::ModelInferRequest request = SdpaRequest();
  request.clear_raw_input_contents();
  for (auto& input : *request.mutable_inputs()) {
    input.mutable_contents()->add_fp32_contents(0.5f);
  }
  ASSERT_TRUE(AttendRequestFrom(request, &outputs).ok());

  request.mutable_inputs(0)->mutable_contents()->add_bytes_contents("junk");
  absl::Status refused = AttendRequestFrom(request, &outputs).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(),
              HasSubstr("input QUERY is FP32 and holds values in "
                        "bytes_contents, expected them in "
                        "contents.fp32_contents or raw_input_contents"));

  request.mutable_inputs(0)->clear_contents();
  request.mutable_inputs(0)->mutable_contents()->add_int64_contents(1);
  refused = AttendRequestFrom(request, &outputs).status();
  EXPECT_THAT(refused.message(),
              HasSubstr("input QUERY is FP32 and holds values in "
                        "int64_contents"));

  request.mutable_inputs(0)->set_datatype("BF16");
  refused = AttendRequestFrom(request, &outputs).status();
  EXPECT_THAT(refused.message(),
              HasSubstr("input QUERY is BF16 and holds values in "
                        "int64_contents, expected them in raw_input_contents "
                        "(its only form)"));
}

// A tensor's bytes are named as the protocol carries them.
TEST(InferenceModelsTest, ATensorsBytesAreNamedAsTheProtocolCarriesThem) {
  const absl::Status renamed = InProtocolNames(
      absl::InvalidArgumentError("key.data has 3 bytes, expected 4"),
      /*weight_set=*/false);
  EXPECT_THAT(renamed.message(),
              HasSubstr("input KEY's data (raw_input_contents or contents) "
                        "has 3 bytes, expected 4"));
  const absl::Status pinned = InProtocolNames(
      absl::FailedPreconditionError(
          "weights_name 'm' is at version 3 on this server, the request's "
          "weights_version is 2; replicas reloading a shared weights_dir "
          "agree within its reload interval: retry, or send weights_version 0 "
          "for any"),
      /*weight_set=*/true);
  EXPECT_THAT(pinned.message(),
              HasSubstr("model 'm' is at version 3 on this server, the "
                        "request's model_version is 2"));
  EXPECT_THAT(pinned.message(),
              HasSubstr("send an empty model_version for any"));
  const absl::Status missing = InProtocolNames(
      absl::InvalidArgumentError("kv_input is missing: weights 'x' project"),
      /*weight_set=*/true);
  EXPECT_THAT(missing.message(), HasSubstr("KV_INPUT is missing"));
}

}  // namespace
}  // namespace attnserve::oip
