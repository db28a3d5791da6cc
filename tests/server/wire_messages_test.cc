#include "attnserve/server/rpc/wire_messages.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnserve/server/rpc/bytes_pool.h"
#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"
#include "server/byte_buffers.h"

namespace attnserve {
namespace {

using google::protobuf::util::MessageDifferencer;

// A tensor of `count` f32 elements with distinct bytes.
v1::Tensor Floats(int64_t count, float start) {
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  tensor.add_shape(count);
  std::vector<float> values(static_cast<size_t>(count));
  for (size_t i = 0; i < values.size(); ++i) values[i] = start + 0.5f * i;
  tensor.set_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

// Whether one of `wire`'s slices starts at `storage`: bytes sent in place.
bool RefersTo(grpc::ByteBuffer& wire, const char* storage) {
  std::vector<grpc::Slice> slices;
  if (!wire.Dump(&slices).ok()) return false;
  for (const grpc::Slice& slice : slices) {
    if (reinterpret_cast<const char*>(slice.begin()) == storage) return true;
  }
  return false;
}

grpc::ByteBuffer Sliced(const std::string& bytes, size_t slice_bytes) {
  return testing::ToByteBuffer(bytes, slice_bytes);
}

v1::AttendRequest LargeRequest() {
  v1::AttendRequest request;
  *request.mutable_query() = Floats(70000, 1.0f);  // 280 kB
  *request.mutable_key() = Floats(20000, 2.0f);    // 80 kB
  *request.mutable_value() = Floats(100, 3.0f);    // Under kMinBytes.
  request.mutable_options()->set_causal(true);
  request.mutable_options()->add_key_lengths(7);
  return request;
}

TEST(BytesPoolTest, TakesTheSmallestKeptStringThatFits) {
  BytesPool pool(int64_t{64} << 20);
  std::string small(size_t{100} << 10, 'a'), large(size_t{1} << 20, 'b');
  const char* large_storage = large.data();
  pool.Give(std::move(small));
  pool.Give(std::move(large));
  EXPECT_EQ(pool.held_bytes(),
            static_cast<int64_t>((size_t{100} << 10) + (size_t{1} << 20)));
  const std::string taken = pool.Take(size_t{960} << 10);
  EXPECT_EQ(taken.data(), large_storage);  // The 100 kB one does not fit.
  EXPECT_TRUE(taken.empty());
  EXPECT_GE(taken.capacity(), size_t{1} << 20);
  EXPECT_EQ(pool.Take(size_t{2} << 20).capacity(), std::string().capacity());
}

// A call holds what it takes until its answer is sent: a string much larger
// than it asked for would hold memory no budget charged it (an audit,
// 2026-12-07: 16 MiB strings for 256 KiB answers left unread, 1.3 GB against 19
// MB).
TEST(BytesPoolTest, HandsOutNoStringMuchLargerThanAskedFor) {
  BytesPool pool(int64_t{64} << 20);
  std::string large(size_t{16} << 20, 'b');
  const char* large_storage = large.data();
  pool.Give(std::move(large));
  EXPECT_EQ(pool.Take(size_t{256} << 10).capacity(), std::string().capacity());
  EXPECT_EQ(pool.Take(size_t{14} << 20).capacity(), std::string().capacity());
  EXPECT_EQ(pool.held_bytes(), int64_t{16} << 20);        // Still kept.
  const std::string taken = pool.Take(size_t{15} << 20);  // 1/15 to spare.
  EXPECT_EQ(taken.data(), large_storage);
  EXPECT_EQ(pool.held_bytes(), 0);
}

TEST(BytesPoolTest, KeepsNothingSmallAndStaysWithinItsBudget) {
  BytesPool pool(int64_t{3} << 20);
  pool.Give(std::string(1000, 'x'));  // Under kMinBytes: freed.
  EXPECT_EQ(pool.held_bytes(), 0);
  for (int i = 0; i < 5; ++i) pool.Give(std::string(size_t{1} << 20, 'x'));
  EXPECT_LE(pool.held_bytes(), int64_t{3} << 20);
  EXPECT_GE(pool.held_bytes(), int64_t{2} << 20);
  pool.Give(std::string(size_t{4} << 20, 'x'));  // Over the whole budget.
  EXPECT_LE(pool.held_bytes(), int64_t{3} << 20);
  BytesPool small(int64_t{64} << 20, 1);
  for (size_t i = 0; i < 2 * BytesPool::kMaxStrings; ++i) {
    small.Give(std::string(100, 'x'));
  }
  EXPECT_LE(small.held_bytes(),
            static_cast<int64_t>(BytesPool::kMaxStrings * 200));
  BytesPool none(0);
  none.Give(std::string(size_t{1} << 20, 'x'));
  EXPECT_EQ(none.held_bytes(), 0);
}

TEST(WireMessagesTest, ParsesIntoKeptStringsWhatAPlainParseGives) {
  const v1::AttendRequest original = LargeRequest();
  const std::string bytes = original.SerializeAsString();
  BytesPool pool(int64_t{64} << 20);
  std::string kept;
  kept.reserve(300000);  // The query's 280 kB fit, with less than 1/8 spare.
  const char* kept_storage = kept.data();
  pool.Give(std::move(kept));

  grpc::ByteBuffer wire = Sliced(bytes, 4096);
  v1::AttendRequest pooled;
  ASSERT_TRUE(ParseWire(&wire, &pooled, &pool).ok());
  EXPECT_EQ(wire.Length(), 0u);  // Consumed.
  EXPECT_TRUE(MessageDifferencer::Equals(pooled, original));
  // The largest tensor went into the kept string; the rest were new.
  EXPECT_EQ(pooled.query().data().data(), kept_storage);
  EXPECT_EQ(pool.held_bytes(), 0);

  GiveTensorBytes(&pooled, &pool);  // The two of at least kMinBytes.
  EXPECT_GE(pool.held_bytes(), 300000 + 80000);
}

TEST(WireMessagesTest, ParsesATensorFieldThatRepeatsAsProtobufMerges) {
  const v1::AttendRequest first = LargeRequest();
  v1::AttendRequest second;
  *second.mutable_query() = Floats(90000, 9.0f);
  const std::string bytes =
      first.SerializeAsString() + second.SerializeAsString();
  v1::AttendRequest expected;
  ASSERT_TRUE(expected.ParseFromString(bytes));
  BytesPool pool(int64_t{64} << 20);
  grpc::ByteBuffer wire = Sliced(bytes, 1000);
  v1::AttendRequest pooled;
  ASSERT_TRUE(ParseWire(&wire, &pooled, &pool).ok());
  EXPECT_TRUE(MessageDifferencer::Equals(pooled, expected));
}

TEST(WireMessagesTest, RefusesTruncatedBytesWithOrWithoutAPool) {
  const std::string bytes = LargeRequest().SerializeAsString();
  for (const size_t cut :
       {size_t{1}, size_t{5}, bytes.size() / 2, bytes.size() - 1}) {
    BytesPool pool(int64_t{64} << 20);
    for (BytesPool* with : {&pool, static_cast<BytesPool*>(nullptr)}) {
      grpc::ByteBuffer wire = Sliced(bytes.substr(0, cut), 4096);
      v1::AttendRequest request;
      const absl::Status parsed = ParseWire(&wire, &request, with);
      EXPECT_EQ(parsed.code(), absl::StatusCode::kInvalidArgument) << cut;
      EXPECT_NE(parsed.message().find("attnserve.v1.AttendRequest"),
                std::string::npos);
    }
  }
}

TEST(WireMessagesTest, RefusesAStrayEndGroupTagAsProtobufDoes) {
  // An end-group tag (field 1, wire type 4) ends a merge early but is not a
  // whole message (found by request_fuzzer).
  const std::string bytes = LargeRequest().SerializeAsString() + "\x0c";
  v1::AttendRequest plain;
  ASSERT_FALSE(plain.ParseFromString(bytes));
  BytesPool pool(int64_t{64} << 20, 1);
  grpc::ByteBuffer wire = Sliced(bytes, 4096);
  v1::AttendRequest request;
  EXPECT_EQ(ParseWire(&wire, &request, &pool).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(WireMessagesTest, SendsLargeTensorsInPlaceAndGivesThemBack) {
  v1::AttendResponse response;
  *response.mutable_output() = Floats(50000, 4.0f);  // 200 kB: sent in place.
  response.mutable_output()->add_shape(1);
  *response.mutable_lse() = Floats(10, 5.0f);  // Small: serialised.
  response.mutable_timing()->set_compute_us(42);
  const v1::AttendResponse original = response;
  const char* output_storage = response.output().data().data();

  auto pool = std::make_shared<BytesPool>(int64_t{64} << 20);
  {
    grpc::ByteBuffer wire;
    ASSERT_TRUE(SerializeWire(&response, &wire, pool).ok());
    EXPECT_TRUE(response.output().data().empty());  // Moved to the wire.
    // The output's field tag and length once more, around its data alone.
    EXPECT_GT(wire.Length(), original.ByteSizeLong());
    EXPECT_LE(wire.Length(), original.ByteSizeLong() + 8);
    EXPECT_TRUE(RefersTo(wire, output_storage));
    v1::AttendResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(testing::ToString(wire)));
    EXPECT_TRUE(MessageDifferencer::Equals(parsed, original));
    EXPECT_EQ(pool->held_bytes(), 0);  // gRPC still holds the bytes.
  }
  EXPECT_GE(pool->held_bytes(), 200000);  // Back once the wire is gone.
  EXPECT_EQ(pool->Take(200000).data(), output_storage);
}

// The Open Inference Protocol's raw_input_contents: large entries parse into
// kept strings, in order, small ones as protobuf parses them.
TEST(WireMessagesTest, ParsesABytesListIntoKeptStringsInOrder) {
  inference::ModelInferRequest original;
  original.set_model_name("sdpa");
  original.add_raw_input_contents(std::string(300000, 'q'));
  original.add_raw_input_contents("small");
  original.add_raw_input_contents(std::string(90000, 'v'));
  original.add_inputs()->set_name("QUERY");
  BytesPool pool(int64_t{64} << 20);
  std::string kept;
  kept.reserve(320000);  // The first entry's 300 kB fit.
  const char* kept_storage = kept.data();
  pool.Give(std::move(kept));

  grpc::ByteBuffer wire = Sliced(original.SerializeAsString(), 4096);
  inference::ModelInferRequest pooled;
  ASSERT_TRUE(ParseWire(&wire, &pooled, &pool).ok());
  EXPECT_TRUE(MessageDifferencer::Equals(pooled, original));
  EXPECT_EQ(pooled.raw_input_contents(0).data(), kept_storage);
  GiveTensorBytes(&pooled, &pool);
  EXPECT_GE(pool.held_bytes(), 320000 + 90000);
}

// raw_output_contents with a large entry leaves whole, in order, after the
// rest of the message: a plain parse gives the same message.
TEST(WireMessagesTest, SendsABytesListInOrderWithItsLargeEntriesInPlace) {
  inference::ModelInferResponse response;
  response.set_model_name("sdpa");
  response.add_outputs()->set_name("OUTPUT");
  response.add_outputs()->set_name("LSE");
  response.add_raw_output_contents(std::string(200000, 'o'));
  response.add_raw_output_contents("tiny lse");
  response.add_raw_output_contents("");
  const inference::ModelInferResponse original = response;
  const char* output_storage = response.raw_output_contents(0).data();
  auto pool = std::make_shared<BytesPool>(int64_t{64} << 20);
  {
    grpc::ByteBuffer wire;
    ASSERT_TRUE(SerializeWire(&response, &wire, pool).ok());
    EXPECT_EQ(wire.Length(), original.ByteSizeLong());
    EXPECT_TRUE(RefersTo(wire, output_storage));
    inference::ModelInferResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(testing::ToString(wire)));
    EXPECT_TRUE(MessageDifferencer::Equals(parsed, original));
  }
  EXPECT_GE(pool->held_bytes(), 200000);
}

// Integers parse into 8 bytes from one: past kMaxRepeatedIntegers in all,
// nested fields included, the request is refused before it is parsed.
TEST(WireMessagesTest, RefusesMoreRepeatedIntegersThanTheLimit) {
  v1::AttendRequest at_limit;
  at_limit.mutable_query()->mutable_shape()->Resize(
      static_cast<int>(kMaxRepeatedIntegers / 2), 1);
  at_limit.mutable_options()->mutable_key_lengths()->Resize(
      static_cast<int>(kMaxRepeatedIntegers / 2), 0);
  grpc::ByteBuffer wire = Sliced(at_limit.SerializeAsString(), 16384);
  v1::AttendRequest parsed;
  EXPECT_TRUE(ParseWire(&wire, &parsed).ok());

  v1::AttendRequest over = at_limit;
  over.mutable_options()->add_key_lengths(3);
  wire = Sliced(over.SerializeAsString(), 16384);
  absl::Status status = ParseWire(&wire, &parsed);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("attnserve.v1.AttentionOptions.key_lengths"),
            std::string::npos)
      << status;
  EXPECT_EQ(wire.Length(), 0u);

  // The Open Inference Protocol's int64_contents, two levels down, unpacked
  // (a tag and a value each).
  const auto delimited = [](char tag, const std::string& payload) {
    std::string field(1, tag);
    for (uint64_t n = payload.size(); true; n >>= 7) {
      field.push_back(static_cast<char>(n < 0x80 ? n : (n & 0x7f) | 0x80));
      if (n < 0x80) break;
    }
    return field + payload;
  };
  std::string unpacked;
  for (int64_t i = 0; i <= kMaxRepeatedIntegers; ++i) unpacked += "\x18\x01";
  // ModelInferRequest.inputs (5), InferInputTensor.contents (5).
  const std::string outer = delimited('\x2a', delimited('\x2a', unpacked));
  inference::ModelInferRequest reference;
  ASSERT_TRUE(reference.ParseFromString(outer));
  ASSERT_EQ(reference.inputs(0).contents().int64_contents_size(),
            kMaxRepeatedIntegers + 1);
  wire = Sliced(outer, 16384);
  inference::ModelInferRequest infer_parsed;
  status = ParseWire(&wire, &infer_parsed);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("int64_contents"), std::string::npos)
      << status;
}

// Repeated entries (messages, strings) and unknown fields parse into objects
// of tens to hundreds of bytes from two or three: past kMaxRepeatedEntries in
// all, the request is refused before it is parsed.
TEST(WireMessagesTest, RefusesMoreRepeatedEntriesThanTheLimit) {
  inference::ModelInferRequest at_limit;
  for (int64_t i = 0; i < kMaxRepeatedEntries; ++i) at_limit.add_inputs();
  grpc::ByteBuffer wire = Sliced(at_limit.SerializeAsString(), 16384);
  inference::ModelInferRequest parsed;
  EXPECT_TRUE(ParseWire(&wire, &parsed).ok());
  EXPECT_EQ(parsed.inputs_size(), kMaxRepeatedEntries);

  inference::ModelInferRequest over = at_limit;
  over.add_outputs();
  wire = Sliced(over.SerializeAsString(), 16384);
  parsed.Clear();
  absl::Status status = ParseWire(&wire, &parsed);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("inference.ModelInferRequest.outputs passed "
                                  "it); the most a request may hold is 65536"),
            std::string::npos)
      << status;
  EXPECT_EQ(wire.Length(), 0u);

  // Unknown fields: field 1000 as a varint of 0, beside a small Attend.
  v1::AttendRequest small;
  *small.mutable_query() = Floats(4, 1.0f);
  std::string unknown = small.SerializeAsString();
  const std::string field_1000("\xc0\x3e\x00",
                               3);  // Tag (1000 << 3, varint), value 0.
  for (int64_t i = 0; i <= kMaxRepeatedEntries; ++i) unknown += field_1000;
  wire = Sliced(unknown, 16384);
  v1::AttendRequest attend;
  status = ParseWire(&wire, &attend);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(
                "unknown field 1000 of attnserve.v1.AttendRequest passed it"),
            std::string::npos)
      << status;
}

// A known field sent in a wire type it does not take is kept as an unknown
// field too (2 bytes on the wire, 16 to 32 parsed): at the top of a message,
// nested in one, or inside an unknown group, each counts as an entry. An
// audit's 60 MiB of them took 2 GB of RSS in the parse.
TEST(WireMessagesTest, CountsFieldsInAWireTypeTheyDoNotTakeAsUnknownFields) {
  const auto many = [](const std::string& field) {
    std::string fields;
    for (int64_t i = 0; i <= kMaxRepeatedEntries; ++i) fields += field;
    return fields;
  };
  // query (a message, field 1) as a varint of 0.
  const std::string top = many(std::string("\x08\x00", 2));
  // options (field 4) holding scale (a float, field 1) as empty bytes.
  const std::string scales = many(std::string("\x0a\x00", 2));
  std::string nested = "\x22";
  uint64_t length = scales.size();
  while (length >= 0x80) {
    nested.push_back(static_cast<char>(length | 0x80));
    length >>= 7;
  }
  nested.push_back(static_cast<char>(length));
  nested += scales;
  // Field 1000 as a group holding varints.
  const std::string group = std::string("\xc3\x3e", 2) +
                            many(std::string("\x08\x00", 2)) +
                            std::string("\xc4\x3e", 2);
  for (const auto& [bytes, named] :
       std::vector<std::pair<std::string, std::string>>{
           {top, "attnserve.v1.AttendRequest.query in wire type 0 passed it"},
           {nested,
            "attnserve.v1.AttentionOptions.scale in wire type 2 passed it"},
           {group,
            "unknown group 1000 of attnserve.v1.AttendRequest passed "
            "it"}}) {
    SCOPED_TRACE(named);
    grpc::ByteBuffer wire = Sliced(bytes, 16384);
    v1::AttendRequest attend;
    const absl::Status status = ParseWire(&wire, &attend);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(named), std::string::npos) << status;
  }
  // Packed and unpacked repeated numbers are the field's own.
  v1::AttendRequest lengths;
  for (int i = 0; i <= kMaxRepeatedEntries; ++i) {
    lengths.mutable_options()->add_key_lengths(1);
  }
  grpc::ByteBuffer wire = Sliced(lengths.SerializeAsString(), 16384);
  v1::AttendRequest parsed;
  EXPECT_TRUE(ParseWire(&wire, &parsed).ok());
  EXPECT_EQ(parsed.options().key_lengths_size(), kMaxRepeatedEntries + 1);
}

TEST(WireMessagesTest, SerialisesWithoutAPoolAsProtobufDoes) {
  v1::AttendResponse response;
  *response.mutable_output() = Floats(50000, 4.0f);
  grpc::ByteBuffer wire;
  ASSERT_TRUE(SerializeWire(&response, &wire).ok());
  EXPECT_EQ(testing::ToString(wire), response.SerializeAsString());
  EXPECT_FALSE(response.output().data().empty());
}

}  // namespace
}  // namespace attnserve
