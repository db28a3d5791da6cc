#include "attnserve/server/rpc/reflection_service.h"

#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/server/rpc/grpc_status.h"
#include "attnserve/server/rpc/wire_messages.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/reflection/v1alpha/reflection.pb.h"

namespace attnserve {
namespace {

using google::protobuf::DescriptorPool;
using google::protobuf::FileDescriptor;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

constexpr const char* kReflectionServices[] = {
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection"};

// The largest reflection request answered: its names are those of protobuf
// files and symbols.
constexpr size_t kMaxReflectionRequestBytes = 4096;

void SetError(grpc::StatusCode code, const std::string& message,
              ServerReflectionResponse* response) {
  response->mutable_error_response()->set_error_code(static_cast<int>(code));
  response->mutable_error_response()->set_error_message(message);
}

// `file` and the files it imports, each once per response (as gRPC's own
// reflection sends them); NOT_FOUND naming `what` if there is no such file.
void AddFile(const FileDescriptor* file, const std::string& what,
             ServerReflectionResponse* response) {
  if (file == nullptr) {
    SetError(grpc::StatusCode::NOT_FOUND, absl::StrCat(what, " is not known"),
             response);
    return;
  }
  std::set<std::string> sent;
  std::vector<const FileDescriptor*> pending = {file};
  while (!pending.empty()) {
    const FileDescriptor* next = pending.back();
    pending.pop_back();
    if (!sent.insert(next->name()).second) continue;
    google::protobuf::FileDescriptorProto proto;
    next->CopyTo(&proto);
    proto.SerializeToString(response->mutable_file_descriptor_response()
                                ->add_file_descriptor_proto());
    for (int i = 0; i < next->dependency_count(); ++i) {
      pending.push_back(next->dependency(i));
    }
  }
}

// The answer to a request of `request_bytes` past kMaxReflectionRequestBytes:
// an error that echoes nothing.
ServerReflectionResponse TooLong(size_t request_bytes) {
  ServerReflectionResponse response;
  SetError(grpc::StatusCode::INVALID_ARGUMENT,
           absl::StrCat("the reflection request is ", request_bytes,
                        " bytes, expected at most ", kMaxReflectionRequestBytes,
                        " (host and names of files and symbols)"),
           &response);
  return response;
}

// The answer to one request.
ServerReflectionResponse Answer(const ServerReflectionRequest& request,
                                const std::vector<std::string>& services) {
  const DescriptorPool& pool = *DescriptorPool::generated_pool();
  // The answer echoes the request (the protocol's original_request) and
  // names what it asked for: a request of names no descriptor has would come
  // back twice its size. Such a request gets an error that echoes nothing.
  const size_t request_bytes = request.ByteSizeLong();
  if (request_bytes > kMaxReflectionRequestBytes) return TooLong(request_bytes);
  ServerReflectionResponse response;
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  switch (request.message_request_case()) {
    case ServerReflectionRequest::kListServices:
      for (const std::string& name : services) {
        response.mutable_list_services_response()->add_service()->set_name(
            name);
      }
      break;
    case ServerReflectionRequest::kFileByFilename:
      AddFile(pool.FindFileByName(request.file_by_filename()),
              absl::StrCat("file ", request.file_by_filename()), &response);
      break;
    case ServerReflectionRequest::kFileContainingSymbol:
      AddFile(pool.FindFileContainingSymbol(request.file_containing_symbol()),
              absl::StrCat("symbol ", request.file_containing_symbol()),
              &response);
      break;
    case ServerReflectionRequest::kFileContainingExtension: {
      const auto& wanted = request.file_containing_extension();
      const google::protobuf::Descriptor* type =
          pool.FindMessageTypeByName(wanted.containing_type());
      const google::protobuf::FieldDescriptor* extension =
          type == nullptr
              ? nullptr
              : pool.FindExtensionByNumber(type, wanted.extension_number());
      AddFile(extension == nullptr ? nullptr : extension->file(),
              absl::StrCat("extension ", wanted.extension_number(), " of ",
                           wanted.containing_type()),
              &response);
      break;
    }
    case ServerReflectionRequest::kAllExtensionNumbersOfType: {
      const google::protobuf::Descriptor* type =
          pool.FindMessageTypeByName(request.all_extension_numbers_of_type());
      if (type == nullptr) {
        SetError(grpc::StatusCode::NOT_FOUND,
                 absl::StrCat("type ", request.all_extension_numbers_of_type(),
                              " is not known"),
                 &response);
        break;
      }
      std::vector<const google::protobuf::FieldDescriptor*> extensions;
      pool.FindAllExtensions(type, &extensions);
      auto* numbers = response.mutable_all_extension_numbers_response();
      numbers->set_base_type_name(type->full_name());
      for (const auto* extension : extensions) {
        numbers->add_extension_number(extension->number());
      }
      break;
    }
    case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
      SetError(grpc::StatusCode::INVALID_ARGUMENT,
               "message_request is not set, expected one of "
               "file_by_filename, file_containing_symbol, "
               "file_containing_extension, all_extension_numbers_of_type, "
               "list_services",
               &response);
      break;
  }
  return response;
}

}  // namespace

// One ServerReflectionInfo stream: each request read is answered before the
// next is read.
class ReflectionService::InfoCall final : public ServerCall {
 public:
  explicit InfoCall(const ReflectionService* service) : service_(service) {}

 private:
  void OnStart() override {
    const absl::Status admitted = service_->gate_->Admit(context());
    if (!admitted.ok()) return Finish(ToGrpcStatus(admitted));
    StartRead(&wire_request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::OK);  // The client is done asking.
    // Answered from its size, unparsed, when too long: a parse is what a
    // flood of tiny fields would fill memory in.
    const size_t request_bytes = wire_request_.Length();
    ServerReflectionResponse response;
    if (request_bytes > kMaxReflectionRequestBytes) {
      wire_request_.Clear();
      response = TooLong(request_bytes);
    } else {
      ServerReflectionRequest request;
      if (!ParseWire(&wire_request_, &request).ok()) {
        return Finish(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            "a request is not a grpc.reflection ServerReflectionRequest"));
      }
      response = Answer(request, service_->services_);
    }
    grpc::ByteBuffer wire_response;
    const absl::Status serialized = SerializeWire(&response, &wire_response);
    if (!serialized.ok()) return Finish(ToGrpcStatus(serialized));
    StartWrite(wire_response);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      return Finish(
          grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    }
    StartRead(&wire_request_);
  }

  const ReflectionService* const service_;
  grpc::ByteBuffer wire_request_;
};

ReflectionService::ReflectionService(const CallGate* gate,
                                     std::vector<std::string> services)
    : gate_(gate), services_(std::move(services)) {
  for (const char* name : kReflectionServices) services_.push_back(name);
}

void ReflectionService::AddTo(CallLoop& loop) {
  for (const char* name : kReflectionServices) {
    loop.Handle(absl::StrCat("/", name, "/ServerReflectionInfo"),
                [this] { return std::make_unique<InfoCall>(this); });
  }
}

}  // namespace attnserve
