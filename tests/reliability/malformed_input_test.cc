// The malformed-input corpus (malformed_corpus.h) sent over gRPC, as raw bytes,
// to a real server on loopback: every case gets its documented code and a
// message naming the field, the server goes on answering valid requests
// correctly, and an AttendStream outlives the bad requests sent on it.
#include <cstdio>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/client/client.h"
#include "attnserve/server/server.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "reference/reference_attention.h"
#include "reliability/malformed_corpus.h"
#include "server/byte_buffers.h"

namespace attnserve::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kService[] = "/attnserve.v1.AttentionService/";

std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(30);
}

// |actual - expected| <= 1e-5 + 1e-5 |expected| elementwise (docs/api.md, F32 /
// FLOAT32).
void ExpectNear(const v1::Tensor& actual, const std::vector<double>& expected) {
  const absl::StatusOr<std::vector<float>> values = Float32Values(actual);
  ASSERT_TRUE(values.ok()) << values.status();
  ASSERT_EQ(values->size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_NEAR((*values)[i], expected[i], 1e-5 + 1e-5 * std::abs(expected[i]))
        << "at " << i;
  }
}

std::vector<float> Values(const v1::Tensor& tensor) {
  return Float32Values(tensor).value();
}

void ExpectCorrectAttend(const v1::AttendRequest& request,
                         const v1::AttendResponse& response) {
  const ReferenceShape shape{2, 4, 2, 5, 7, 8, 3};
  ExpectNear(response.output(),
             ReferenceAttention(shape, Values(request.query()),
                                Values(request.key()), Values(request.value()))
                 .output);
}

void ExpectCorrectMultiHead(const v1::MultiHeadAttentionRequest& request,
                            const v1::MultiHeadAttentionResponse& response) {
  const v1::ProjectionWeights& w = request.weights();
  const ReferenceMhaWeights weights{
      Values(w.w_q()), Values(w.w_k()), Values(w.w_v()), Values(w.w_o()),
      Values(w.b_q()), Values(w.b_k()), Values(w.b_v()), Values(w.b_o())};
  const ReferenceMhaShape shape{2, 3, 5, 8, 6, 2, 1, 4, 4};
  ExpectNear(response.output(),
             ReferenceMultiHeadAttention(shape, Values(request.query_input()),
                                         Values(request.kv_input()), weights)
                 .output);
}

class MalformedInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.address = "127.0.0.1";
    options.port = 0;
    options.transport.max_message_bytes = kCorpusMaxMessageBytes;
    options.engine.max_workspace_bytes = kCorpusMaxWorkspaceBytes;
    options.limits.max_elements = kCorpusMaxElements;
    options.limits.max_request_memory_bytes = kCorpusMaxRequestMemoryBytes;
    // The scratch-limit cases are sized by the scores the unfused path holds
    // (as every request asking for weights needs); the fused kernel's scratch
    // does not grow with them (validation_test shows the same request
    // computed there). Validation is otherwise the same on both paths.
    options.engine.kernel = AttentionKernel::kUnfused;
    absl::StatusOr<std::unique_ptr<AttnServer>> server =
        AttnServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::AttentionService::NewStub(channel_);
    generic_ = std::make_unique<grpc::GenericStub>(channel_);
  }

  // Sends `body` as the request of `method`, byte for byte.
  grpc::Status CallRaw(const std::string& method, const std::string& body,
                       std::string* response_bytes) {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    const grpc::ByteBuffer request = ToByteBuffer(body);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    generic_->UnaryCall(
        &context, kService + method, grpc::StubOptions(), &request, &response,
        [&done](grpc::Status status) { done.set_value(std::move(status)); });
    const grpc::Status status = done.get_future().get();
    if (status.ok()) *response_bytes = ToString(response);
    return status;
  }

  void ExpectServesValidRequests() {
    grpc::ClientContext attend_context;
    attend_context.set_deadline(Deadline());
    const v1::AttendRequest attend = ValidAttendRequest();
    v1::AttendResponse attend_response;
    const grpc::Status attend_status =
        stub_->Attend(&attend_context, attend, &attend_response);
    ASSERT_TRUE(attend_status.ok()) << attend_status.error_message();
    ExpectCorrectAttend(attend, attend_response);

    grpc::ClientContext mha_context;
    mha_context.set_deadline(Deadline());
    const v1::MultiHeadAttentionRequest mha = ValidMultiHeadRequest();
    v1::MultiHeadAttentionResponse mha_response;
    const grpc::Status mha_status =
        stub_->MultiHeadAttention(&mha_context, mha, &mha_response);
    ASSERT_TRUE(mha_status.ok()) << mha_status.error_message();
    ExpectCorrectMultiHead(mha, mha_response);
  }

  void ExpectServing() {
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(absl::StrCat("127.0.0.1:", server_->port()));
    ASSERT_TRUE(client.ok()) << client.status();
    const auto health = (*client)->CheckHealth("", absl::Seconds(10));
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  }

  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;
};

TEST(MalformedCorpusTest, HasAtLeastFiftyUniquelyNamedCases) {
  const std::vector<MalformedCase> corpus = MalformedCorpus();
  std::printf("corpus: %zu cases\n", corpus.size());
  EXPECT_GE(corpus.size(), 50u);
  std::set<std::string> names;
  for (const MalformedCase& c : corpus) {
    EXPECT_TRUE(names.insert(c.method + "/" + c.name).second) << c.name;
    EXPECT_FALSE(c.parts.empty()) << c.name;
  }
}

TEST_F(MalformedInputTest,
       EveryCaseGetsItsCodeNamingTheFieldAndTheServerStaysCorrect) {
  ExpectServesValidRequests();
  for (const MalformedCase& c : MalformedCorpus()) {
    SCOPED_TRACE(c.method + "/" + c.name);
    std::string response;
    const grpc::Status status = CallRaw(c.method, c.body(), &response);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    for (const std::string& part : c.parts) {
      EXPECT_THAT(status.error_message(), HasSubstr(part));
    }
  }
  ExpectServesValidRequests();
  ExpectServing();
}

// Every Attend case that fits in a message, sent on one stream between valid
// requests: each bad request gets its own error answer, in order, and the valid
// ones are answered correctly.
TEST_F(MalformedInputTest, AttendStreamAnswersValidRequestsAroundBadOnes) {
  std::vector<const MalformedCase*> bad;
  const std::vector<MalformedCase> corpus = AttendCorpus();
  for (const MalformedCase& c : corpus) {
    if (c.name != "RequestOverMessageLimit") bad.push_back(&c);
  }
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  auto stream = stub_->AttendStream(&context);
  const v1::AttendRequest valid = ValidAttendRequest();
  for (const MalformedCase* c : bad) {
    v1::AttendRequest request;
    ASSERT_TRUE(request.ParseFromString(c->body())) << c->name;
    ASSERT_TRUE(stream->Write(valid));
    ASSERT_TRUE(stream->Write(request));
  }
  ASSERT_TRUE(stream->Write(valid));
  ASSERT_TRUE(stream->WritesDone());
  v1::AttendStreamResponse answer;
  for (size_t i = 0; i <= 2 * bad.size(); ++i) {
    ASSERT_TRUE(stream->Read(&answer)) << "answer " << i;
    ASSERT_EQ(answer.index(), static_cast<int64_t>(i));
    if (i % 2 == 0) {
      ASSERT_FALSE(answer.has_error()) << answer.error().message();
      ExpectCorrectAttend(valid, answer.response());
      continue;
    }
    const MalformedCase& c = *bad[i / 2];
    SCOPED_TRACE(c.name);
    EXPECT_FALSE(answer.has_response());
    EXPECT_EQ(answer.error().code(), static_cast<int>(c.code))
        << answer.error().message();
    for (const std::string& part : c.parts) {
      EXPECT_THAT(answer.error().message(), HasSubstr(part));
    }
  }
  EXPECT_FALSE(stream->Read(&answer));
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  ExpectServesValidRequests();
}

// Bytes that are not an AttendRequest in the middle of a stream fail only their
// own answer, as any bad request does: the answers before and after them
// arrive, and the stream ends OK.
TEST_F(MalformedInputTest,
       AttendStreamAnswersAnUnparsableMessageWithItsOwnError) {
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream(grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer,
                                                       grpc::ByteBuffer>::
                 Create(channel_.get(),
                        grpc::internal::RpcMethod(
                            absl::StrCat(kService, "AttendStream").c_str(),
                            grpc::internal::RpcMethod::BIDI_STREAMING),
                        &context));
  const std::string valid = ValidAttendRequest().SerializeAsString();
  const std::string truncated = valid.substr(0, valid.size() - 5);
  for (const std::string* message : {&valid, &truncated, &valid}) {
    ASSERT_TRUE(stream->Write(ToByteBuffer(*message)));
  }
  ASSERT_TRUE(stream->WritesDone());
  for (int64_t index = 0; index < 3; ++index) {
    grpc::ByteBuffer answer_bytes;
    ASSERT_TRUE(stream->Read(&answer_bytes)) << "answer " << index;
    v1::AttendStreamResponse answer;
    ASSERT_TRUE(answer.ParseFromString(ToString(answer_bytes)));
    EXPECT_EQ(answer.index(), index);
    if (index == 1) {
      EXPECT_EQ(answer.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(answer.error().message(),
                  HasSubstr(absl::StrCat(
                      "the request is not a valid attnserve.v1.AttendRequest: "
                      "its ",
                      truncated.size(), " bytes could not be parsed")));
    } else {
      ASSERT_FALSE(answer.has_error()) << answer.error().message();
      ExpectCorrectAttend(ValidAttendRequest(), answer.response());
    }
  }
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  ExpectServesValidRequests();
}

}  // namespace
}  // namespace attnserve::testing
