#include "attnserve/server/rpc/wire_messages.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/common/allocation_failures.h"
#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attnserve {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

constexpr int kTensorDataField = v1::Tensor::kDataFieldNumber;

bool IsTensorField(const FieldDescriptor& field) {
  return !field.is_repeated() &&
         field.type() == FieldDescriptor::TYPE_MESSAGE &&
         field.message_type() == v1::Tensor::descriptor();
}

// A message's own repeated bytes field (the Open Inference Protocol's
// raw_input_contents and raw_output_contents): its entries are tensors' bytes.
bool IsBytesList(const FieldDescriptor& field) {
  return field.is_repeated() && field.type() == FieldDescriptor::TYPE_BYTES;
}

// The strings of `message`'s repeated string `field`, to move in and out.
// Reflection's replacement (GetMutableRepeatedFieldRef) only copies strings,
// and moving them is the point, hence the deprecated accessor.
google::protobuf::RepeatedPtrField<std::string>* MutableStrings(
    Message* message, const FieldDescriptor* field) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return message->GetReflection()->MutableRepeatedPtrField<std::string>(message,
                                                                        field);
#pragma GCC diagnostic pop
}

// The message's bytes lists that hold entries.
std::vector<std::pair<int, google::protobuf::RepeatedPtrField<std::string>*>>
SetBytesLists(Message* message) {
  std::vector<std::pair<int, google::protobuf::RepeatedPtrField<std::string>*>>
      lists;
  const google::protobuf::Descriptor* type = message->GetDescriptor();
  const google::protobuf::Reflection* reflection = message->GetReflection();
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor& field = *type->field(i);
    if (IsBytesList(field) && reflection->FieldSize(*message, &field) > 0) {
      lists.emplace_back(field.number(), MutableStrings(message, &field));
    }
  }
  return lists;
}

// The message's Tensor fields that are set, with their field numbers.
std::vector<std::pair<int, v1::Tensor*>> SetTensors(Message* message) {
  std::vector<std::pair<int, v1::Tensor*>> tensors;
  const google::protobuf::Descriptor* type = message->GetDescriptor();
  const google::protobuf::Reflection* reflection = message->GetReflection();
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor& field = *type->field(i);
    if (IsTensorField(field) && reflection->HasField(*message, &field)) {
      tensors.emplace_back(field.number(),
                           static_cast<v1::Tensor*>(
                               reflection->MutableMessage(message, &field)));
    }
  }
  return tensors;
}

// The data sizes of the Tensor fields of a `type` message that `wire` carries,
// one entry per occurrence, and of each entry of its bytes lists. Best effort:
// it stops at the first thing it cannot read, and the parse then says what is
// wrong. The sizes are claims, not yet checked: they only choose among strings
// the pool already holds.
std::vector<std::pair<const FieldDescriptor*, uint32_t>> TensorDataSizes(
    grpc::ByteBuffer* wire, const google::protobuf::Descriptor& type) {
  std::vector<std::pair<const FieldDescriptor*, uint32_t>> sizes;
  grpc::ProtoBufferReader reader(wire);
  if (!reader.status().ok()) return sizes;
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  while (const uint32_t tag = in.ReadTag()) {
    const FieldDescriptor* field =
        type.FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    const bool delimited = WireFormatLite::GetTagWireType(tag) ==
                           WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
    if (field != nullptr && IsBytesList(*field) && delimited) {
      uint32_t size = 0;
      if (!in.ReadVarint32(&size)) break;
      sizes.emplace_back(field, size);
      if (!in.Skip(static_cast<int>(size))) break;
      continue;
    }
    if (field == nullptr || !IsTensorField(*field) || !delimited) {
      if (!WireFormatLite::SkipField(&in, tag)) break;
      continue;
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length)) break;
    const CodedInputStream::Limit limit =
        in.PushLimit(static_cast<int>(length));
    while (const uint32_t inner = in.ReadTag()) {
      if (inner ==
          WireFormatLite::MakeTag(kTensorDataField,
                                  WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
        uint32_t size = 0;
        if (!in.ReadVarint32(&size)) break;
        sizes.emplace_back(field, size);
        if (!in.Skip(static_cast<int>(size))) break;
      } else if (!WireFormatLite::SkipField(&in, inner)) {
        break;
      }
    }
    in.PopLimit(limit);
  }
  return sizes;
}

bool IsRepeatedVarint(const FieldDescriptor& field) {
  if (!field.is_repeated()) return false;
  switch (field.type()) {
    case FieldDescriptor::TYPE_INT32:
    case FieldDescriptor::TYPE_INT64:
    case FieldDescriptor::TYPE_UINT32:
    case FieldDescriptor::TYPE_UINT64:
    case FieldDescriptor::TYPE_SINT32:
    case FieldDescriptor::TYPE_SINT64:
    case FieldDescriptor::TYPE_ENUM:
      return true;
    default:
      return false;
  }
}

// Whether `field` parses a value of `wire_type` into itself (repeated numbers
// also come packed); a value of another wire type is kept as an unknown field.
bool TakesWireType(const FieldDescriptor& field,
                   WireFormatLite::WireType wire_type) {
  const WireFormatLite::WireType own = WireFormatLite::WireTypeForFieldType(
      static_cast<WireFormatLite::FieldType>(field.type()));
  return wire_type == own ||
         (field.is_packable() &&
          wire_type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
}

// What a parse would allocate objects for, counted before it.
struct ParsedCounts {
  int64_t integers = 0;  // Of repeated varint fields.
  int64_t entries = 0;  // Of repeated messages, strings, bytes; unknown fields.
  std::string passed;   // The field that passed a limit, or empty.
};

// Counts the fields of the unknown group `start` opened (each is kept as an
// unknown field, a nested group's as well) up to its end; false once the
// count passes its limit or the bytes cannot be read.
bool CountGroup(CodedInputStream& in, uint32_t start,
                const google::protobuf::Descriptor& type, int depth,
                ParsedCounts* counts) {
  const int number = WireFormatLite::GetTagFieldNumber(start);
  while (const uint32_t tag = in.ReadTag()) {
    const auto wire_type = WireFormatLite::GetTagWireType(tag);
    if (wire_type == WireFormatLite::WIRETYPE_END_GROUP) {
      return WireFormatLite::GetTagFieldNumber(tag) == number;
    }
    if (++counts->entries > kMaxRepeatedEntries) {
      counts->passed =
          absl::StrCat("unknown group ", number, " of ", type.full_name());
      return false;
    }
    if (wire_type == WireFormatLite::WIRETYPE_START_GROUP) {
      if (depth >= 100 || !CountGroup(in, tag, type, depth + 1, counts)) {
        return false;
      }
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return false;
    }
  }
  return false;
}

// Counts, in `in` (a `type` message), nested messages included, into
// `*counts`; stops once a count passes its limit (kMaxRepeatedIntegers,
// kMaxRepeatedEntries), naming the field. Best effort: it stops at the first
// thing it cannot read, and the parse then says what is wrong.
void CountParsed(CodedInputStream& in, const google::protobuf::Descriptor& type,
                 int depth, ParsedCounts* counts) {
  while (const uint32_t tag = in.ReadTag()) {
    const FieldDescriptor* field =
        type.FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    const auto wire_type = WireFormatLite::GetTagWireType(tag);
    // A field of an unknown number, or of a known one sent in a wire type it
    // does not take, is kept as an unknown field.
    const bool unknown = field == nullptr || !TakesWireType(*field, wire_type);
    if (unknown || (field->is_repeated() && !IsRepeatedVarint(*field) &&
                    wire_type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) {
      // An unknown field is kept as one, an entry as its object.
      if (++counts->entries > kMaxRepeatedEntries) {
        counts->passed =
            field == nullptr
                ? absl::StrCat("unknown field ",
                               WireFormatLite::GetTagFieldNumber(tag), " of ",
                               type.full_name())
            : unknown ? absl::StrCat(field->full_name(), " in wire type ",
                                     static_cast<int>(wire_type))
                      : field->full_name();
        return;
      }
    }
    if (unknown) {
      if (wire_type == WireFormatLite::WIRETYPE_START_GROUP) {
        if (!CountGroup(in, tag, type, depth, counts)) return;
      } else if (!WireFormatLite::SkipField(&in, tag)) {
        return;
      }
      continue;
    }
    if (IsRepeatedVarint(*field)) {
      int64_t* count = &counts->integers;
      if (wire_type == WireFormatLite::WIRETYPE_VARINT) {
        uint64_t ignored = 0;
        if (!in.ReadVarint64(&ignored)) return;
        ++*count;
      } else if (wire_type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        // Packed: one integer per byte without the continuation bit.
        uint32_t length = 0;
        if (!in.ReadVarint32(&length)) return;
        const void* data = nullptr;
        int size = 0;
        uint32_t left = length;
        while (left > 0 && in.GetDirectBufferPointer(&data, &size)) {
          const int take = std::min<int64_t>(size, left);
          const auto* bytes = static_cast<const uint8_t*>(data);
          for (int i = 0; i < take; ++i) *count += bytes[i] < 0x80;
          in.Skip(take);
          left -= static_cast<uint32_t>(take);
        }
        if (left > 0) return;
      } else if (!WireFormatLite::SkipField(&in, tag)) {
        return;
      }
      if (*count > kMaxRepeatedIntegers) {
        counts->passed = field->full_name();
        return;
      }
      continue;
    }
    if (depth < 16 && field->type() == FieldDescriptor::TYPE_MESSAGE &&
        wire_type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length)) return;
      const CodedInputStream::Limit limit_at =
          in.PushLimit(static_cast<int>(length));
      CountParsed(in, *field->message_type(), depth + 1, counts);
      if (!counts->passed.empty()) return;
      in.Skip(in.BytesUntilLimit());
      in.PopLimit(limit_at);
      continue;
    }
    if (!WireFormatLite::SkipField(&in, tag)) return;
  }
}

// INVALID_ARGUMENT if `wire` (a `type` message) holds more than
// kMaxRepeatedIntegers integers in repeated fields, or more than
// kMaxRepeatedEntries repeated entries and unknown fields: each parses into
// more bytes than it takes on the wire, so their counts, not the message's
// size, bound the parse's memory.
absl::Status CheckParsedCounts(grpc::ByteBuffer* wire,
                               const google::protobuf::Descriptor& type) {
  grpc::ProtoBufferReader reader(wire);
  if (!reader.status().ok()) return absl::OkStatus();
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  ParsedCounts counts;
  CountParsed(in, type, 0, &counts);
  if (counts.passed.empty()) return absl::OkStatus();
  if (counts.integers > kMaxRepeatedIntegers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the request's repeated integer fields hold more than ",
        kMaxRepeatedIntegers, " values (", counts.passed,
        " passed it); the most a request may hold is ", kMaxRepeatedIntegers));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "the request's repeated message, string and bytes fields and unknown "
      "fields hold more than ",
      kMaxRepeatedEntries, " entries (", counts.passed,
      " passed it); the most a request may hold is ", kMaxRepeatedEntries));
}

// A tensor's bytes on their way out: owned by the slice that refers to them,
// given back to the pool when gRPC drops the slice.
struct SentBytes {
  std::string bytes;
  std::shared_ptr<BytesPool> pool;

  static void Release(void* sent) {
    auto* self = static_cast<SentBytes*>(sent);
    self->pool->Give(std::move(self->bytes));
    delete self;
  }
};

// Owns a SentBytes until a slice takes it: a failed allocation before then
// gives its bytes back to the pool rather than leaking them.
struct ReleaseSentBytes {
  void operator()(SentBytes* sent) const { SentBytes::Release(sent); }
};
using SentBytesPtr = std::unique_ptr<SentBytes, ReleaseSentBytes>;

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>(value | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

absl::Status SerializeError(const Message& message, const std::string& why) {
  return absl::InternalError(absl::StrCat("could not serialise the ",
                                          message.GetDescriptor()->full_name(),
                                          " answer: ", why));
}

// ParseWire, but for a failed allocation, which it throws.
absl::Status ParseWireOrThrow(grpc::ByteBuffer* wire, Message* message,
                              BytesPool* pool) {
  const size_t bytes = wire->Length();
  // Cheap for a message of tensors: their bytes are skipped, not read. A
  // message this small holds fewer of either than their limits.
  if (bytes > static_cast<size_t>(kMaxRepeatedEntries)) {
    const absl::Status counted =
        CheckParsedCounts(wire, *message->GetDescriptor());
    if (!counted.ok()) {
      wire->Clear();
      return counted;
    }
  }
  bool parsed = false;
  bool seeded = false;  // Some tensor holds a kept string.
  // A message under min_bytes carries no tensor worth a kept string.
  if (pool != nullptr && bytes >= pool->min_bytes()) {
    // Give each tensor the bytes carry a kept string that fits its data (a
    // tensor the bytes carry is set after the parse in any case).
    for (const auto& [field, size] :
         TensorDataSizes(wire, *message->GetDescriptor())) {
      if (IsBytesList(*field)) {
        // Parsed entries reuse a list's cleared strings, in order: one per
        // entry, kept strings for the large ones.
        auto* list = MutableStrings(message, field);
        *list->Add() =
            size < pool->min_bytes() ? std::string() : pool->Take(size);
        seeded = seeded || size >= pool->min_bytes();
        continue;
      }
      if (size < pool->min_bytes()) continue;
      auto* tensor = static_cast<v1::Tensor*>(
          message->GetReflection()->MutableMessage(message, field));
      if (tensor->data().capacity() < size) {
        pool->Give(std::move(*tensor->mutable_data()));
        *tensor->mutable_data() = pool->Take(size);
      }
      seeded = true;
    }
  }
  for (const auto& [number, list] : SetBytesLists(message)) list->Clear();
  {
    grpc::ProtoBufferReader reader(wire);
    if (reader.status().ok() && seeded) {
      // Merging into the empty message is a parse that keeps those strings.
      CodedInputStream in(&reader);
      in.SetTotalBytesLimit(std::numeric_limits<int>::max());
      // Stopping at an end-group tag is a valid merge but not a whole
      // message, which a parse requires.
      parsed = message->MergeFromCodedStream(&in) && in.ConsumedEntireMessage();
    } else if (reader.status().ok()) {
      parsed = message->ParseFromZeroCopyStream(&reader);
    }
  }
  wire->Clear();
  if (parsed) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the request is not a valid ", message->GetDescriptor()->full_name(),
      ": its ", bytes,
      " bytes could not be parsed (truncated, not protobuf wire format, or a "
      "string field that is not UTF-8)"));
}

// SerializeWire, but for a failed allocation, which it throws.
absl::Status SerializeWireOrThrow(Message* message, grpc::ByteBuffer* wire,
                                  const std::shared_ptr<BytesPool>& pool) {
  if (pool == nullptr) {
    bool own_buffer = false;
    const grpc::Status status = grpc::SerializationTraits<Message>::Serialize(
        *message, wire, &own_buffer);
    if (status.ok()) return absl::OkStatus();
    return SerializeError(*message, status.error_message());
  }
  // Take the large tensors' data out, serialise the rest, then append each as
  // its Tensor field again holding only `data`, by reference.
  std::vector<std::pair<int, SentBytesPtr>> sent;
  for (const auto& [number, tensor] : SetTensors(message)) {
    if (tensor->data().size() < pool->min_bytes()) continue;
    sent.emplace_back(number, SentBytesPtr(new SentBytes{{}, pool}));
    sent.back().second->bytes = std::move(*tensor->mutable_data());
  }
  // A bytes list with a large entry leaves whole (its order is its meaning)
  // and follows the rest, each entry as an occurrence of its field, the large
  // ones by reference.
  std::vector<std::pair<int, std::vector<SentBytesPtr>>> lists;
  size_t list_entries = 0;
  for (const auto& [number, list] : SetBytesLists(message)) {
    bool large = false;
    for (const std::string& entry : *list) {
      large = large || entry.size() >= pool->min_bytes();
    }
    if (!large) continue;
    lists.emplace_back(number, std::vector<SentBytesPtr>());
    std::vector<SentBytesPtr>& entries = lists.back().second;
    entries.reserve(static_cast<size_t>(list->size()));
    for (std::string& entry : *list) {
      entries.emplace_back(new SentBytes{{}, pool});
      entries.back()->bytes = std::move(entry);
    }
    list->Clear();
    list_entries += entries.size();
  }
  std::string head;
  const bool serialised = message->SerializeToString(&head);
  size_t total = head.size();
  std::vector<grpc::Slice> slices;
  // Room for every slice first: a slice made takes its bytes' ownership,
  // and nothing may throw after that.
  slices.reserve(1 + 2 * list_entries + 2 * sent.size());
  slices.emplace_back(head);
  for (auto& [number, entries] : lists) {
    for (SentBytesPtr& owned : entries) {
      SentBytes* const entry = owned.get();
      const size_t size = entry->bytes.size();
      std::string header;
      AppendVarint(WireFormatLite::MakeTag(
                       number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                   &header);
      AppendVarint(size, &header);
      total += header.size() + size;
      slices.emplace_back(header);
      if (size > 0) {
        slices.emplace_back(entry->bytes.data(), size, &SentBytes::Release,
                            owned.release());
      }
    }
  }
  for (auto& [number, owned] : sent) {
    SentBytes* const bytes = owned.get();
    const size_t size = bytes->bytes.size();
    std::string inner;  // The data field's tag and length.
    AppendVarint(
        WireFormatLite::MakeTag(kTensorDataField,
                                WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
        &inner);
    AppendVarint(size, &inner);
    std::string header;  // The Tensor field's tag and length, then inner.
    AppendVarint(WireFormatLite::MakeTag(
                     number, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                 &header);
    AppendVarint(inner.size() + size, &header);
    header += inner;
    total += header.size() + size;
    slices.emplace_back(header);
    slices.emplace_back(bytes->bytes.data(), size, &SentBytes::Release,
                        owned.release());
  }
  if (!serialised ||
      total > static_cast<size_t>(std::numeric_limits<int>::max()))
    return SerializeError(*message, "over 2 GiB");
  grpc::ByteBuffer(slices.data(), slices.size()).Swap(wire);
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseWire(grpc::ByteBuffer* wire, Message* message,
                       BytesPool* pool) {
  const size_t bytes = wire->Length();
  try {
    return ParseWireOrThrow(wire, message, pool);
  } catch (const std::bad_alloc&) {
    wire->Clear();
    return AllocationFailed(
        absl::StrCat("parse the request's ", bytes, " bytes"));
  }
}

absl::Status SerializeWire(Message* message, grpc::ByteBuffer* wire,
                           const std::shared_ptr<BytesPool>& pool) {
  try {
    return SerializeWireOrThrow(message, wire, pool);
  } catch (const std::bad_alloc&) {
    return AllocationFailed(absl::StrCat(
        "serialise the ", message->GetDescriptor()->full_name(), " answer"));
  }
}

void GiveTensorBytes(Message* message, BytesPool* pool) {
  for (const auto& [number, tensor] : SetTensors(message)) {
    pool->Give(std::move(*tensor->mutable_data()));
  }
  for (const auto& [number, list] : SetBytesLists(message)) {
    for (std::string& entry : *list) pool->Give(std::move(entry));
  }
}

}  // namespace attnserve
