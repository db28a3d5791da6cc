#include "attnserve/server/rpc/health_service.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attnserve/common/echo.h"
#include "attnserve/server/rpc/wire_messages.h"

namespace attnserve {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

constexpr char kService[] = "/grpc.health.v1.Health/";

// A service name, as gRPC names services ("package.Service"), of at most
// kMaxEchoBytes; "" is the whole server.
constexpr size_t kMaxServiceNameBytes = kMaxEchoBytes;
// A request holding such a name, with room for its field tag and length.
constexpr size_t kMaxRequestBytes = kMaxServiceNameBytes + 8;

// Parses the request a read brought (`read` false: none came) and checks its
// service name. The health service needs no token, so a request too large to
// hold a service name is refused before it is parsed.
grpc::Status ReadRequest(bool read, grpc::ByteBuffer* wire,
                         HealthCheckRequest* request) {
  if (!read) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "the call ended before its request arrived");
  }
  if (wire->Length() > kMaxRequestBytes) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("the request is ", wire->Length(),
                     " bytes, expected at most ", kMaxRequestBytes,
                     " (a service name of at most ", kMaxServiceNameBytes,
                     " bytes)"));
  }
  if (!ParseWire(wire, request).ok()) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "the request is not a grpc.health.v1.HealthCheckRequest");
  }
  if (!IsPlainName(request->service(), kMaxServiceNameBytes)) {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("service is ", EchoText(request->service()),
                     ", expected at most ", kMaxServiceNameBytes,
                     " characters of [A-Za-z0-9._-]"));
  }
  return grpc::Status::OK;
}

grpc::ByteBuffer Serialized(HealthCheckResponse response) {
  grpc::ByteBuffer wire;
  // A message of one enum field always serialises.
  SerializeWire(&response, &wire).IgnoreError();
  return wire;
}

}  // namespace

class HealthService::CheckCall final : public ServerCall {
 public:
  explicit CheckCall(HealthService* health) : health_(health) {}

 private:
  void OnStart() override { StartRead(&wire_request_); }

  void OnReadDone(bool ok) override {
    HealthCheckRequest request;
    const grpc::Status read = ReadRequest(ok, &wire_request_, &request);
    if (!read.ok()) return Finish(read);
    HealthCheckResponse response;
    {
      absl::MutexLock lock(&health_->mutex_);
      response.set_status(health_->StatusOf(request.service()));
    }
    if (response.status() == HealthCheckResponse::SERVICE_UNKNOWN) {
      return Finish(grpc::Status(
          grpc::StatusCode::NOT_FOUND,
          absl::StrCat("unknown service ", EchoText(request.service()),
                       ", expected \"\" (the server) or one of: ",
                       absl::StrJoin(health_->services_, ", "))));
    }
    FinishWithMessage(Serialized(response), grpc::Status::OK);
  }

  HealthService* const health_;
  grpc::ByteBuffer wire_request_;
};

class HealthService::WatchCall final : public ServerCall {
 public:
  explicit WatchCall(HealthService* health) : health_(health) {}

  const std::string& service() const { return service_; }

  // Writes `status` unless it is the last one written; while a write is in
  // flight only the latest status waits.
  void Send(Status status) ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::MutexLock lock(&mutex_);
    latest_ = status;
    WriteLatest();
  }

  // Ends the call with `status` once the write in flight (if any) is done.
  void End(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mutex_) {
    absl::MutexLock lock(&mutex_);
    if (ending_) return;
    ending_ = true;
    final_status_ = status;
    if (!writing_) Finish(final_status_);
  }

 private:
  void OnStart() override { StartRead(&wire_request_); }

  void OnReadDone(bool ok) override {
    HealthCheckRequest request;
    const grpc::Status read = ReadRequest(ok, &wire_request_, &request);
    if (!read.ok()) return End(read);
    service_ = request.service();
    health_->AddWatcher(this);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mutex_);
    writing_ = false;
    // A failed write means the call is over; OnCancel ends it.
    if (ending_) {
      Finish(final_status_);
    } else if (ok) {
      WriteLatest();
    }
  }

  void OnCancel() override {
    health_->RemoveWatcher(this);
    End(grpc::Status(grpc::StatusCode::CANCELLED, "the watch was cancelled"));
  }

  void OnDone() override { health_->RemoveWatcher(this); }

  void WriteLatest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    if (ending_ || writing_ || latest_ == written_) return;
    HealthCheckResponse response;
    response.set_status(latest_);
    written_ = latest_;
    writing_ = true;
    StartWrite(Serialized(response));
  }

  HealthService* const health_;
  grpc::ByteBuffer wire_request_;
  std::string service_;  // Set before the call is shared.

  absl::Mutex mutex_;
  Status latest_ ABSL_GUARDED_BY(mutex_) = HealthCheckResponse::UNKNOWN;
  // UNKNOWN is never a service's status, so the first one is always written.
  Status written_ ABSL_GUARDED_BY(mutex_) = HealthCheckResponse::UNKNOWN;
  bool writing_ ABSL_GUARDED_BY(mutex_) = false;
  bool ending_ ABSL_GUARDED_BY(mutex_) = false;
  grpc::Status final_status_ ABSL_GUARDED_BY(mutex_);
};

HealthService::HealthService(const std::vector<std::string>& services)
    : services_(services.begin(), services.end()) {}

void HealthService::AddTo(CallLoop& loop) {
  // A check is answered even when the memory budget is in use, so that a
  // busy server is not restarted by its liveness probe.
  loop.Handle(
      absl::StrCat(kService, "Check"),
      [this] { return std::make_unique<CheckCall>(this); },
      CallLoop::Admission::kAlways);
  loop.Handle(absl::StrCat(kService, "Watch"),
              [this] { return std::make_unique<WatchCall>(this); });
}

HealthService::Status HealthService::StatusOf(
    const std::string& service) const {
  if (!service.empty() && services_.count(service) == 0) {
    return HealthCheckResponse::SERVICE_UNKNOWN;
  }
  return serving_ ? HealthCheckResponse::SERVING
                  : HealthCheckResponse::NOT_SERVING;
}

void HealthService::SetServing(bool serving) {
  absl::MutexLock lock(&mutex_);
  if (shut_down_) return;
  serving_ = serving;
  for (WatchCall* watcher : watchers_) {
    watcher->Send(StatusOf(watcher->service()));
  }
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mutex_);
  shut_down_ = true;
  serving_ = false;
  for (WatchCall* watcher : watchers_) {
    watcher->Send(StatusOf(watcher->service()));
    watcher->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "the server is shutting down"));
  }
}

void HealthService::AddWatcher(WatchCall* watcher) {
  absl::MutexLock lock(&mutex_);
  watchers_.insert(watcher);
  watcher->Send(StatusOf(watcher->service()));
  if (shut_down_) {
    watcher->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "the server is shutting down"));
  }
}

void HealthService::RemoveWatcher(WatchCall* watcher) {
  absl::MutexLock lock(&mutex_);
  watchers_.erase(watcher);
}

}  // namespace attnserve
